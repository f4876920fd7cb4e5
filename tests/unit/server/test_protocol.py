"""The server's external shapes without a model: HTTP request bodies and the sampling
parameters they become, and token-id prompts checked without changing their meaning."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from minisgl.sampling_params import SamplingParams
from minisgl.server.errors import param_of
from minisgl.server.native_protocol import GenerateRequest
from minisgl.server.protocol import (
    MAX_TOKEN_ID,
    ChatCompletionRequest,
    CompletionRequest,
    server_params,
)

MSG = [{"role": "user", "content": "hi"}]


# ---------------------------------------------------------------- request bodies
def test_chat_defaults_fill_the_context() -> None:
    params = ChatCompletionRequest(messages=MSG).to_sampling_params()
    assert params.max_tokens is None  # the scheduler fills it with the room left
    assert params.temperature == 1.0 and params.n == 1 and params.stop == []


def test_max_completion_tokens_wins() -> None:
    req = ChatCompletionRequest(messages=MSG, max_tokens=10, max_completion_tokens=3)
    assert req.to_sampling_params().max_tokens == 3


def test_chat_message_parts_and_roles() -> None:
    req = ChatCompletionRequest(
        messages=[
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None},
        ]
    )
    assert [m["content"] for m in req.message_dicts()] == ["be brief", "ab", ""]
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[])


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"n": 1000}, "n"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"seed": 2**70}, "seed"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        # Not implemented: refused by name rather than silently ignored.
        ({"logit_bias": {"42": 5.0}}, "logit_bias"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "regex": "a"}, "response_format"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
        ({"json_schema": "{oops"}, "json_schema"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_invalid_values_name_their_field(extra: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError) as err:
        ChatCompletionRequest(messages=MSG, **extra).to_sampling_params()
    assert param_of(str(err.value)) == field


def test_completion_prompt_forms() -> None:
    def prompts(p: object) -> list[object]:
        return CompletionRequest(prompt=p).prompts()

    assert prompts("a") == ["a"]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([1, 2]) == [[1, 2]]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]
    for bad in (["a", [1]], [True], [-1], [[]], 5, None, {"a": 1}):
        with pytest.raises(ValueError):
            prompts(bad)
    with pytest.raises(ValueError, match="empty"):
        prompts([])


def test_completion_logprobs_ask_for_alternatives() -> None:
    params = CompletionRequest(prompt="x", logprobs=3).to_sampling_params()
    assert params.logprobs is True and params.top_logprobs == 3
    assert params.prompt_logprobs is None  # scored only with echo
    echo = CompletionRequest(prompt="x", logprobs=2, echo=True).to_sampling_params()
    assert echo.prompt_logprobs == 2
    assert CompletionRequest(prompt="x").to_sampling_params().max_tokens == 16


def test_generate_request() -> None:
    req = GenerateRequest(text="hi", sampling_params={"max_new_tokens": 5, "sampling_seed": 7})
    params = req.to_sampling_params()
    assert params.max_tokens == 5 and params.seed == 7
    assert req.prompts() == (["hi"], False)
    assert GenerateRequest(input_ids=[[1], [2]]).prompts() == ([[1], [2]], True)
    with pytest.raises(ValidationError):  # a misspelt option is an error, not ignored
        GenerateRequest(text="hi", sampling_params={"max_tokens": 5})
    with pytest.raises(ValueError):
        GenerateRequest().prompts()
    with pytest.raises(ValueError):
        GenerateRequest(text="a", input_ids=[1]).prompts()


def test_choices_get_distinct_seeds() -> None:
    params = server_params(SamplingParams(max_tokens=4, seed=10, n=3))
    seeds = [params.for_choice(i).seed for i in range(3)]
    assert seeds == [10, 11, 12]
    assert all(params.for_choice(i).n == 1 for i in range(3))
    assert params.n == 3  # a copy per choice: the request's own params are unchanged
    unseeded = server_params(SamplingParams(max_tokens=4))
    assert unseeded.for_choice(1).seed is None


def test_priority_field_is_strict() -> None:
    """vLLM's / SGLang's `priority`: an integer in the signed 64-bit range (it crosses IPC as
    msgpack); a bool, a numeric string or a float is a 400 naming the field."""
    msgs = [{"role": "user", "content": "hi"}]
    assert GenerateRequest(text="x", priority=-4).priority == -4
    assert ChatCompletionRequest(messages=msgs, priority=7).priority == 7  # type: ignore[arg-type]
    assert CompletionRequest(prompt="x", priority=2**63 - 1).priority == 2**63 - 1
    assert GenerateRequest(text="x").priority is None
    for bad in (True, "1", 1.0, 2**63, -(2**63) - 1):
        with pytest.raises(ValidationError) as info:
            GenerateRequest(text="x", priority=bad)
        assert info.value.errors()[0]["loc"] == ("priority",)


# ---------------------------------------------------------------- unimplemented fields


def test_neutral_forms_of_unimplemented_fields_are_accepted() -> None:
    """What clients send by default (empty lists/maps, the text format) is not an error."""
    neutral = dict(logit_bias={}, response_format={"type": "text"}, tools=[], tool_choice="auto")
    ChatCompletionRequest(messages=MSG, **neutral).to_sampling_params()
    CompletionRequest(
        prompt="a", logit_bias={}, response_format={"type": "text"}
    ).to_sampling_params()


def test_response_format_becomes_a_json_schema() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    params = ChatCompletionRequest(messages=MSG, response_format=fmt).to_sampling_params()
    assert json.loads(params.json_schema or "") == schema
    params = CompletionRequest(
        prompt="a", response_format={"type": "json_object"}
    ).to_sampling_params()
    assert json.loads(params.json_schema or "") == {"type": "object"}
    params = CompletionRequest(prompt="a", regex="[0-9]+").to_sampling_params()
    assert params.regex == "[0-9]+" and params.json_schema is None
    native = GenerateRequest(text="a", sampling_params={"ebnf": 'root ::= "a"'})
    assert native.to_sampling_params().ebnf == 'root ::= "a"'


# ---------------------------------------------------------------- token-id prompts
def test_token_id_prompts_are_checked_without_changing_meaning() -> None:
    ids = list(range(2100))
    assert CompletionRequest(prompt=ids).prompts() == [ids]
    assert CompletionRequest(prompt=[[1, 2], [3]]).prompts() == [[1, 2], [3]]
    assert CompletionRequest(prompt=[0, MAX_TOKEN_ID]).prompts() == [[0, MAX_TOKEN_ID]]
    bad = [[1, True], [1, -1], [1, MAX_TOKEN_ID + 1], [1, 2.0], [1, "2"], [[1], [True]], [[1], []]]
    for prompt in bad:
        with pytest.raises(ValueError, match="prompt must be"):
            CompletionRequest(prompt=prompt).prompts()
