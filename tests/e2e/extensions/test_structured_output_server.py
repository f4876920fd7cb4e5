"""Structured output through the server (default model, CPU): OpenAI's ``response_format``
driven by the official openai client, SGLang's ``regex`` / ``ebnf`` / ``json_schema`` on
/generate and as OpenAI extras; outputs checked with ``jsonschema`` and ``re.fullmatch``.
A grammar that does not compile is a 400 naming the field, and the server keeps serving with
no KV page held. Tool calls (forced by tool_choice, so a model that never calls tools on its
own still does) and reasoning_content (forced by a grammar) ride on the same mechanism; under
a reasoning parser a grammar waits for the end of the thinking (few-shot turns make the model
think on its own)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletion

from tests.e2e.server_utils import (
    ServerHandle,
    assert_clean_log,
    start_server,
    wait_idle_and_check,
)
from tests.workloads import thinking_chat

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

MODEL = "smollm2"
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe Paris as JSON."}]


@pytest.fixture(scope="module")
def client(default_server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=default_server.url("/v1"), api_key="none", max_retries=0, timeout=300
    )


def test_chat_json_schema(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    out = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=96,
        temperature=0,
        response_format=fmt,  # type: ignore[arg-type]
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content or ""), CITY)


@pytest.mark.slow  # json_object and streaming beside test_chat_json_schema's whole reply
def test_chat_json_object_sampled_n2_and_streamed(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=128,
        temperature=0.7,
        seed=11,
        n=2,
        response_format={"type": "json_object"},
    )
    for choice in out.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content or ""), dict)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=96,
        temperature=0,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), CITY)


def test_completions_regex_extra(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL,
        prompt="A phone number: ",
        max_tokens=24,
        temperature=0,
        extra_body={"regex": r"\(\d{3}\) \d{3}-\d{4}"},
    )
    assert out.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", out.choices[0].text), out.choices[0].text


def test_native_generate_ebnf_and_regex(default_server: ServerHandle) -> None:
    grammar = 'root ::= ("red" | "green" | "blue") " and " ("cat" | "dog")'
    status, out = default_server.post(
        "/generate",
        {
            "text": ["My favourite colour and pet:", "Pick a number:"],
            "sampling_params": {"temperature": 0, "max_new_tokens": 16, "ebnf": grammar},
        },
    )
    assert status == 200, out
    for item in out:
        assert re.fullmatch(r"(red|green|blue) and (cat|dog)", item["text"]), item
        assert item["meta_info"]["finish_reason"]["type"] == "stop"
    status, out = default_server.post(
        "/generate",
        {"text": "Year:", "sampling_params": {"temperature": 0, "max_new_tokens": 8, "regex": "(19|20)[0-9]{2}"}},
    )  # fmt: skip
    assert status == 200 and re.fullmatch("(19|20)[0-9]{2}", out["text"]), out


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "regex": "([a-z"}, "regex"),
        ("/generate", {"text": "Hi", "sampling_params": {"ebnf": "root ::= nope"}}, "ebnf"),
        (
            "/v1/chat/completions",
            {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            "json_schema",
        ),
    ],
)  # fmt: skip
def test_grammar_that_does_not_compile_is_400(
    default_server: ServerHandle, path: str, body: dict[str, object], field: str
) -> None:
    status, out = default_server.post(
        path, {"model": MODEL, **body} if path != "/generate" else body
    )
    assert status == 400, out
    err = out["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == field, err
    status, good = default_server.post(
        "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
    )
    assert status == 200, good
    wait_idle_and_check(default_server)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tool_choice_required_and_named(client: openai.OpenAI) -> None:
    for choice, name in [("required", None), ({"type": "function", "function": {"name": "get_time"}}, "get_time")]:  # fmt: skip
        out = client.chat.completions.create(
            model=MODEL,
            messages=WEATHER_Q,  # type: ignore[arg-type]
            tools=[WEATHER, TIME],  # type: ignore[list-item]
            tool_choice=choice,  # type: ignore[arg-type]
            max_tokens=64,
            temperature=0,
        )
        choice0 = out.choices[0]
        assert choice0.finish_reason == "tool_calls", choice0
        calls = choice0.message.tool_calls or []
        assert len(calls) == 1 and calls[0].type == "function"
        fn = calls[0].function  # type: ignore[union-attr]
        if name is not None:
            assert fn.name == name
        schema = {"get_weather": WEATHER, "get_time": TIME}[fn.name]["function"]["parameters"]
        jsonschema.validate(json.loads(fn.arguments), schema)


def test_tool_call_streamed_and_answered(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_Q,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        max_tokens=64,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["tool_calls"]
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].function is not None
    assert deltas[0].function.name == "get_weather"
    args = deltas[0].function.arguments or ""
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<tool_call>" not in content
    # The conversation goes on with the call and its result (rendered by the template).
    follow = client.chat.completions.create(
        model=MODEL,
        messages=[
            *WEATHER_Q,
            {"role": "assistant", "content": None, "tool_calls": [{"id": deltas[0].id or "call_0", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
            {"role": "tool", "tool_call_id": deltas[0].id or "call_0", "content": "Sunny, 21 C"},
        ],  # type: ignore[list-item]
        tools=[WEATHER],  # type: ignore[list-item]
        max_tokens=16,
        temperature=0,
    )  # fmt: skip
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


def chat_logprobs_streamed_as_whole(client: openai.OpenAI, **ask: Any) -> ChatCompletion:
    """A greedy chat request with logprobs (top 2), whole and streamed: one logprobs entry
    per completion token (what usage counts; nothing the reply parsers hold back or split
    off is dropped or repeated), the same entries both ways. Tokens a grammar rules out have
    log(0) = -inf among the alternatives: they come as vLLM's floor, -9999, valid JSON."""
    kwargs = dict(model=MODEL, temperature=0, logprobs=True, top_logprobs=2, **ask)
    whole = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    ChatCompletion.model_validate(whole.model_dump())
    assert whole.usage is not None and whole.choices[0].logprobs is not None
    content = whole.choices[0].logprobs.content or []
    assert len(content) == whole.usage.completion_tokens
    stream = client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )  # type: ignore[call-overload]
    chunks = list(stream)
    streamed = [
        e for ch in chunks for c in ch.choices if c.logprobs for e in c.logprobs.content or []
    ]
    assert chunks[-1].usage is not None
    assert len(streamed) == chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
        assert all(-9999 <= t.logprob <= 0 for t in e.top_logprobs)
    return whole


def test_tool_call_logprobs_streamed_as_whole(client: openai.OpenAI) -> None:
    out = chat_logprobs_streamed_as_whole(
        client, messages=WEATHER_Q, tools=[WEATHER, TIME], tool_choice="required", max_tokens=64
    )
    assert out.choices[0].finish_reason == "tool_calls"
    assert len(out.choices[0].message.tool_calls or []) == 1


# Two calls in a row, forced by a grammar while tool_choice stays "auto" (the model is free
# to call tools, and parsing is not limited to one call by a forced choice's grammar).
TWO_CALLS = "root ::= " + json.dumps(
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
)


@pytest.mark.slow  # the tool parser's unit tests cover the flag; this repeats it over HTTP
def test_parallel_tool_calls_false_returns_one_call(client: openai.OpenAI) -> None:
    """parallel_tool_calls=false: at most one call comes back, the reply's first (vLLM keeps
    the first too), whole and streamed. The finish reason shows the grammar ran to its end,
    so both calls were generated (without the flag both come back: unit-tested)."""
    ask: dict[str, Any] = dict(
        model=MODEL, messages=WEATHER_Q, tools=[WEATHER, TIME], tool_choice="auto",
        max_tokens=160, temperature=0, extra_body={"ebnf": TWO_CALLS}, parallel_tool_calls=False,
    )  # fmt: skip
    choice = client.chat.completions.create(**ask).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]  # type: ignore[union-attr]
    assert calls == [("get_time", "{}")]
    chunks = list(client.chat.completions.create(**ask, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function and d.function.name) for d in deltas] == [(0, "get_time")]
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["tool_calls"]


@pytest.fixture(scope="module")
def thinking_server() -> Iterator[ServerHandle]:
    """The default model behind --reasoning-parser qwen3; its replies are made to think by a
    grammar (SmolLM2 does not think on its own)."""
    server = start_server(["--served-model-name", MODEL, "--reasoning-parser", "qwen3"])
    yield server
    assert server.stop() == 0, server.log()[-3000:]
    assert_clean_log(server)


THINK = 'root ::= "<think>" [a-z]{1,12} " " [a-z]{1,12} "</think>" "\\n\\n" ("Paris" | "Lyon") "."'


@pytest.mark.slow  # a second default-model server for one test; the parser: test_reasoning.py
def test_reasoning_content_split_off(thinking_server: ServerHandle) -> None:
    client = openai.OpenAI(base_url=thinking_server.url("/v1"), api_key="none", max_retries=0)
    ask = {"model": MODEL, "messages": ASK, "max_tokens": 48, "temperature": 0}
    # A grammar that spells out the thinking itself must apply from the first token: with
    # thinking on it would wait for "</think>" (test_grammar_waits_for_the_thinking).
    force = {"ebnf": THINK, "chat_template_kwargs": {"enable_thinking": False}}
    out = client.chat.completions.create(**ask, extra_body=force)  # type: ignore[call-overload]
    message = out.choices[0].message
    thought = (message.model_extra or {}).get("reasoning_content")
    assert re.fullmatch(r"[a-z]+ [a-z]+", thought or ""), message
    assert message.content in ("Paris.", "Lyon."), message
    stream = client.chat.completions.create(**ask, stream=True, extra_body=force)  # type: ignore[call-overload]
    chunks = [c.choices[0].delta for c in stream if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in chunks) == thought
    assert "".join(d.content or "" for d in chunks) == message.content
    kept = client.chat.completions.create(**ask, extra_body={**force, "separate_reasoning": False})  # type: ignore[call-overload]
    assert kept.choices[0].message.content == f"<think>{thought}</think>\n\n{message.content}"
    # Logprobs with the reasoning parser: every token's entry, thinking included.
    logged = chat_logprobs_streamed_as_whole(client, messages=ASK, max_tokens=48, extra_body=force)
    assert logged.choices[0].message.content == message.content
    wait_idle_and_check(thinking_server)


THINKING_ASK = thinking_chat()  # ends with ASK's question


@pytest.mark.slow  # tests/unit/extensions/structured_output covers the wait; this repeats it over HTTP
def test_grammar_waits_for_the_thinking(thinking_server: ServerHandle) -> None:
    """Under --reasoning-parser a response_format leaves the thinking free: reasoning_content
    is what the model thinks with no format at all, and content matches the schema. With
    enable_thinking false the schema applies from the first token (the reply is JSON)."""
    client = openai.OpenAI(base_url=thinking_server.url("/v1"), api_key="none", max_retries=0)
    ask = {"model": MODEL, "messages": THINKING_ASK, "max_tokens": 64, "temperature": 0}
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    free = client.chat.completions.create(**ask).choices[0].message  # type: ignore[call-overload]
    thought = (free.model_extra or {}).get("reasoning_content")
    assert thought and "{" not in thought, free  # the arrangement: it thinks, then answers
    out = client.chat.completions.create(**ask, n=2, response_format=fmt)  # type: ignore[call-overload]
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice
        assert (choice.message.model_extra or {}).get("reasoning_content") == thought, choice
        jsonschema.validate(json.loads(choice.message.content or ""), CITY)
    stream = client.chat.completions.create(**ask, stream=True, response_format=fmt)  # type: ignore[call-overload]
    chunks = [c.choices[0].delta for c in stream if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in chunks) == thought
    assert json.loads("".join(d.content or "" for d in chunks)) == json.loads(
        out.choices[0].message.content or ""
    )
    off = client.chat.completions.create(
        **ask,
        response_format={"type": "json_object"},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # type: ignore[call-overload]
    message = off.choices[0].message
    assert (message.model_extra or {}).get("reasoning_content") is None, message
    assert isinstance(json.loads(message.content or ""), dict), message
    wait_idle_and_check(thinking_server)
