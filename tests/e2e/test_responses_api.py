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


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"temperature": -1}, "temperature"),
        ({"text": {"format": "json"}}, "text"),
    ],
)  # fmt: skip
def test_unsupported_is_400(default_server: ServerHandle, extra: dict, field: str) -> None:
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 4, **extra}
    status, out = default_server.post("/v1/responses", body)
    assert status == 400, out
    assert out["error"]["param"] == field and out["error"]["type"] == "invalid_request_error"
    wait_idle_and_check(default_server)
