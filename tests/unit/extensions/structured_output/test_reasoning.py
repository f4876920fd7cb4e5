"""Reasoning parsers (extensions/structured_output/reasoning.py) and the chat reply parser
that combines them with tool calls (chat_reply.py there): whole replies, and the same replies
streamed in pieces split at every position must give the same reasoning, content and calls;
and when a chat request's grammar waits for the end of the thinking (the chat hook, chat.py
there)."""

from __future__ import annotations

import json

import pytest

from minisgl.extensions.structured_output.chat import ReasoningOptions
from minisgl.extensions.structured_output.chat_reply import ChatReplyParser
from minisgl.extensions.structured_output.reasoning import (
    StreamingReasoningParser,
    split_reasoning,
)
from minisgl.server.args import ServerArgs
from minisgl.server.chat_hooks import chat_hook
from minisgl.server.protocol import ChatCompletionRequest

CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


@pytest.mark.parametrize(
    ("parser", "text", "want"),
    [
        ("qwen3", "<think>\nhmm, 2+2\n</think>\n\nIt is 4.", ("\nhmm, 2+2\n", "It is 4.")),
        ("qwen3", "It is 4.", (None, "It is 4.")),
        ("qwen3", "  <think>a</think>b", ("a", "b")),
        ("qwen3", "<think>cut off befo", ("cut off befo", "")),
        ("qwen3", "<thin", (None, "<thin")),  # never became the tag
        ("qwen3", "a <think>b</think>", (None, "a <think>b</think>")),  # not leading
        ("deepseek-r1", "step 1\nstep 2</think>\n\nDone.", ("step 1\nstep 2", "Done.")),
        ("deepseek-r1", "<think>x</think>y", ("x", "y")),
        ("deepseek-r1", "all thinking, no end", ("all thinking, no end", "")),
        ("deepseek-r1", "a</thi", ("a</thi", "")),
    ],
)
def test_split_reasoning(parser: str, text: str, want: tuple[str | None, str]) -> None:
    assert split_reasoning(text, parser) == want
    for cut in range(len(text) + 1):
        for step in (1, 2, 5):
            stream = StreamingReasoningParser(parser)
            pieces = [text[:cut]] + [text[i : i + step] for i in range(cut, len(text), step)]
            got = [stream.feed(p) for p in pieces] + [stream.finish()]
            reasoning = "".join(r for r, _ in got)
            content = "".join(c for _, c in got)
            assert (reasoning if stream.saw_reasoning else None, content) == want, (cut, step)


def test_unknown_parser_is_an_error() -> None:
    with pytest.raises(ValueError, match="reasoning_parser"):
        StreamingReasoningParser("nope")


@pytest.mark.parametrize("reasoning", [None, "qwen3"])
def test_reply_with_thinking_and_calls_streamed_equals_whole(reasoning: str | None) -> None:
    text = ("<think>I should call f.</think>\n\n" if reasoning else "") + "Calling.\n" + CALL
    message, calls = ChatReplyParser(reasoning, tools=True).whole(text)
    assert message["content"] == "Calling."
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"x": 1}]
    if reasoning:
        assert message["reasoning_content"] == "I should call f."
    for cut in range(len(text) + 1):
        reply = ChatReplyParser(reasoning, tools=True)
        deltas = [reply.feed(text[:cut]), reply.feed(text[cut:])]
        last, streamed_calls = reply.finish()
        deltas.append(last)
        assert "".join(d.get("content", "") for d in deltas).strip() == "Calling."
        thought = "".join(d.get("reasoning_content", "") for d in deltas)
        assert thought == ("I should call f." if reasoning else "")
        assert [c["function"] for c in streamed_calls] == [c["function"] for c in calls]


JSON_OBJECT = {"response_format": {"type": "json_object"}}


@pytest.mark.parametrize(
    ("parser", "extra", "want"),
    [
        ("qwen3", JSON_OBJECT, "</think>"),
        ("deepseek-r1", {"regex": "[0-9]+"}, "</think>"),
        ("qwen3", {**JSON_OBJECT, "separate_reasoning": False}, "</think>"),  # it still thinks
        ("qwen3", {**JSON_OBJECT, "chat_template_kwargs": {"enable_thinking": True}}, "</think>"),
        ("qwen3", {**JSON_OBJECT, "chat_template_kwargs": {"enable_thinking": False}}, None),
        (None, JSON_OBJECT, None),  # no reasoning parser: as before
        ("qwen3", {}, None),  # no grammar
    ],
)
def test_chat_grammar_waits_for_the_thinking(
    parser: str | None, extra: dict[str, object], want: str | None
) -> None:
    """Under a reasoning parser a chat request's grammar applies after "</think>" (the
    scheduler's grammar_after), unless the request switched thinking off."""
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **extra)  # type: ignore[arg-type]
    hook = chat_hook(ServerArgs(extensions=(ReasoningOptions(parser),)))
    assert body.to_sampling_params(hook).grammar_after == want


def test_reasoning_parser_flag_is_checked() -> None:
    with pytest.raises(ValueError, match="reasoning_parser"):
        ReasoningOptions("nope")
