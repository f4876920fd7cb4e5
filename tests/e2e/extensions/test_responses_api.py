"""OpenAI's Responses API (/v1/responses) with the official openai client, against the default
model in a real server: the reply equals the chat completion of the same conversation,
streamed events come in the API's order and add up to the same text, ``text.format``
constrains the output, and what is not implemented is a 400 naming the field."""

from __future__ import annotations

import json

import openai
import pytest

from tests.e2e.server_utils import ServerHandle, wait_idle_and_check

MODEL = "smollm2"
ASK = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(default_server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=default_server.url("/v1"), api_key="none", max_retries=0, timeout=300
    )


def test_response_equals_chat_completion(client: openai.OpenAI) -> None:
    resp = client.responses.create(
        model=MODEL, input=ASK, instructions="Answer briefly.", max_output_tokens=12,
        temperature=0,
    )  # fmt: skip
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": ASK}],
        max_tokens=12, temperature=0,
    )  # fmt: skip
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.output_text == chat.choices[0].message.content
    assert resp.output[0].type == "message" and resp.output[0].role == "assistant"
    finish = chat.choices[0].finish_reason
    assert resp.status == ("incomplete" if finish == "length" else "completed")
    if finish == "length":
        assert resp.incomplete_details and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage is not None and chat.usage is not None
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    # The same conversation given as a message list, text parts included.
    listed = client.responses.create(
        model=MODEL, max_output_tokens=12, temperature=0,
        input=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "input_text", "text": ASK}]},
        ],
    )  # fmt: skip
    assert listed.output_text == resp.output_text


def test_streamed_events(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=MODEL, input=ASK, max_output_tokens=10, temperature=0)
    events = list(
        client.responses.create(
            model=MODEL, input=ASK, max_output_tokens=10, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:-1] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
    ]  # fmt: skip
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert set(kinds[4:-4]) <= {"response.output_text.delta"}
    seqs = [e.sequence_number for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text  # type: ignore[union-attr]


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    resp = client.responses.create(
        model=MODEL, input=ASK, max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
    )  # fmt: skip
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), schema)


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.mark.slow  # forced calls: the chat tool tests; Responses events: test_streamed_events
def test_function_call_forced_streamed_and_answered(client: openai.OpenAI) -> None:
    """tool_choice "required" (a grammar makes the small model call): a function_call item
    whose arguments match the schema, the same when streamed; then the call and its output go
    back as input items and the conversation continues."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    ask = {"model": MODEL, "input": "Weather in Paris?", "tools": [WEATHER],
           "tool_choice": "required", "max_output_tokens": 96, "temperature": 0}  # fmt: skip
    resp = client.responses.create(**ask)  # type: ignore[call-overload]
    calls = [item for item in resp.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", resp.output
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    events = list(client.responses.create(**ask, stream=True))  # type: ignore[call-overload]
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    final = events[-1].response  # type: ignore[union-attr]
    streamed = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(calls[0].name, calls[0].arguments)]
    follow = client.responses.create(
        model=MODEL, tools=[WEATHER], max_output_tokens=12, temperature=0,  # type: ignore[list-item]
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
             "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny"},
        ],
    )  # fmt: skip
    assert follow.status in ("completed", "incomplete") and follow.usage is not None


@pytest.mark.slow  # the forced call's test covers the path; this adds the flag's echo
def test_parallel_tool_calls_echoed_and_applied(client: openai.OpenAI) -> None:
    """The request's parallel_tool_calls comes back (true unless set, as OpenAI's default), in
    the whole response and in the stream's; false keeps only the reply's first call (the chat
    rule; a two-call reply is unit-tested in
    tests/unit/extensions/responses/test_events.py)."""
    pytest.importorskip("xgrammar")
    ask = {"model": MODEL, "input": "Weather in Paris?", "tools": [WEATHER],
           "tool_choice": "required", "max_output_tokens": 96, "temperature": 0,
           "parallel_tool_calls": False}  # fmt: skip
    resp = client.responses.create(**ask)  # type: ignore[call-overload]
    assert resp.parallel_tool_calls is False
    assert [item.type for item in resp.output].count("function_call") == 1, resp.output
    events = list(client.responses.create(**ask, stream=True))  # type: ignore[call-overload]
    assert events[0].response.parallel_tool_calls is False  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert final.parallel_tool_calls is False
    assert [item.type for item in final.output].count("function_call") == 1, final.output
    plain = client.responses.create(model=MODEL, input=ASK, max_output_tokens=2)
    assert plain.parallel_tool_calls is True


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"temperature": -1}, "temperature"),
        ({"text": {"format": "json"}}, "text"),
        ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{oops"}]},
         "tool_calls"),
    ],
)  # fmt: skip
def test_unsupported_is_400(default_server: ServerHandle, extra: dict, field: str) -> None:
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 4, **extra}
    status, out = default_server.post("/v1/responses", body)
    assert status == 400, out
    assert out["error"]["param"] == field and out["error"]["type"] == "invalid_request_error"
    wait_idle_and_check(default_server)
