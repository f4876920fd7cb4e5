"""Tool-call parsing (extensions/structured_output/tool_calls.py): the Hermes format in full replies and streamed in
pieces split at every position, validation of tools / tool_choice, and the grammar that a
forced tool_choice compiles to (accepting exactly one call of the right function with
schema-valid arguments)."""

from __future__ import annotations

import json

import pytest

from minisgl.extensions.structured_output.chat_reply import ChatReplyParser
from minisgl.extensions.structured_output.tool_calls import (
    StreamingToolParser,
    call_grammar,
    check_tools,
    parse_tool_calls,
)
from minisgl.server.errors import param_of
from minisgl.server.protocol import ChatCompletionRequest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
REPLY = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
MSG = [{"role": "user", "content": "hi"}]


def test_parse_full_reply() -> None:
    content, calls = parse_tool_calls(REPLY)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 2}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize(
    "text",
    [
        "No tools needed.",
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "get_time", "arguments": {}}',  # cut off before the end tag
    ],
)
def test_replies_without_valid_calls_are_content(text: str) -> None:
    assert parse_tool_calls(text) == (text, [])


@pytest.mark.parametrize("text", [REPLY, "Plain <tool answer> text <tool_ca", "<tool_call>\n{x}"])
def test_streaming_equals_full_parse_at_every_split(text: str) -> None:
    want_content, want_calls = parse_tool_calls(text)
    for cut in range(len(text) + 1):
        for step in (1, 3, 7):
            parser = StreamingToolParser()
            pieces = [text[:cut]] + [text[i : i + step] for i in range(cut, len(text), step)]
            sent = "".join(parser.feed(p) for p in pieces)
            rest, calls = parser.finish()
            sent += rest
            names = [c["function"] for c in calls]
            assert names == [c["function"] for c in want_calls]
            if calls:
                assert sent.strip() == (want_content or "")
            else:
                assert sent == text


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls_false_keeps_the_first_call(parallel: bool) -> None:
    """vLLM's rule: with parallel_tool_calls false only the reply's first call comes back,
    whole or streamed in pieces; the content before the calls is kept either way."""
    want = ["get_weather", "get_time"] if parallel else ["get_weather"]
    message, calls = ChatReplyParser(None, True, parallel).whole(REPLY)
    assert [c["function"]["name"] for c in calls] == want
    assert message["tool_calls"] == calls and message["content"] == "Let me check."
    reply = ChatReplyParser(None, True, parallel)
    sent = "".join(reply.feed(REPLY[i : i + 5]).get("content", "") for i in range(0, len(REPLY), 5))
    last, streamed = reply.finish()
    assert [c["function"] for c in streamed] == [c["function"] for c in calls]
    assert (sent + last.get("content", "")).strip() == "Let me check."


@pytest.mark.parametrize(
    ("tools", "choice", "field"),
    [
        ([{"type": "retrieval"}], "auto", "tools"),
        ([{"type": "function", "function": {"description": "x"}}], "auto", "tools"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([], "required", "tool_choice"),
    ],
)
def test_bad_tools_name_their_field(tools: list, choice: object, field: str) -> None:
    with pytest.raises(ValueError) as err:
        check_tools(tools, choice)
    assert param_of(str(err.value)) == field
    with pytest.raises(ValueError) as err:
        ChatCompletionRequest(messages=MSG, tools=tools, tool_choice=choice).to_sampling_params()
    assert param_of(str(err.value)) == field


def test_forced_choice_grammar_accepts_exactly_one_right_call() -> None:
    xgr = pytest.importorskip("xgrammar")
    assert call_grammar([WEATHER], "auto") is None
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, good, bad in [
        (
            named,
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        ),
        (
            "required",
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
            '<tool_call>\n{"name": "get_weather", "arguments": {"days": 1}}\n</tool_call>',
        ),
    ]:
        ebnf = call_grammar([WEATHER, TIME], choice)
        assert ebnf is not None
        info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)] + ["\n"])
        compiled = xgr.GrammarCompiler(info).compile_grammar(ebnf)
        ok = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        assert ok.accept_string(good) and ok.is_completed()
        no = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        assert not (no.accept_string(bad) and no.is_completed())
    params = ChatCompletionRequest(
        messages=MSG, tools=[WEATHER, TIME], tool_choice="required"
    ).to_sampling_params()
    assert params.ebnf is not None


def test_earlier_calls_reach_the_template_as_objects() -> None:
    req = ChatCompletionRequest(
        messages=[
            *MSG,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
        ],
        tools=[TIME],
    )
    msgs = req.message_dicts()
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"tz": "UTC"}
    assert msgs[2] == {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}
    assert req.submit_base().tools == [TIME]
    no_tools = ChatCompletionRequest(messages=MSG, tools=[TIME], tool_choice="none")
    assert no_tools.submit_base().tools is None
