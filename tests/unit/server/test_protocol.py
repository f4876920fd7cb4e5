"""The server's external shapes without a model: HTTP request bodies and their sampling
parameters, the IPC message codec, and the command line."""

from __future__ import annotations

import dataclasses
import json

import pytest
from pydantic import ValidationError

from minisgl.cli import build_parser, engine_config
from minisgl.config import EngineConfig, option_names
from minisgl.ipc.codec import decode, encode
from minisgl.ipc.messages import (
    AddRequests,
    StepOutputs,
    SubmitItem,
    SubmitRequest,
    TokenizedRequest,
    TokenLogprob,
    TokenOutput,
    TopLogprob,
)
from minisgl.sampling_params import SamplingParams
from minisgl.server.errors import param_of
from minisgl.server.native_protocol import GenerateRequest
from minisgl.server.protocol import ChatCompletionRequest, CompletionRequest, server_params

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


def test_sampling_params_are_built_once_and_frozen() -> None:
    """One validated object from the route to the scheduler: frozen, its checks run when it
    is built (not when it is copied per choice, or decoded from IPC)."""
    params = SamplingParams(max_tokens=None, stop="x", stop_regex=r"\d")
    assert params.stop == ["x"] and params.stop_regex == [r"\d"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5  # type: ignore[misc]
    with pytest.raises(ValueError, match="min_tokens"):
        dataclasses.replace(params, max_tokens=1, min_tokens=2)
    # The server's "fill the context", resolved by the scheduler process.
    assert params.with_max_tokens(7).max_tokens == 7
    with pytest.raises(ValueError, match="min_tokens"):
        dataclasses.replace(params, min_tokens=5).with_max_tokens(4)


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


# ---------------------------------------------------------------- IPC codec
def test_messages_round_trip() -> None:
    fill = SamplingParams(max_tokens=None)
    template = {"enable_thinking": False}
    logprob = TokenLogprob(7, -0.5, [TopLogprob(7, -0.5), TopLogprob(9, -1.5)])
    msgs = [
        SubmitRequest([SubmitItem(1, messages=MSG, params=fill, return_prompt_text=True)]),
        SubmitRequest(
            [
                SubmitItem(
                    5,
                    messages=MSG,
                    chat_template_kwargs=template,
                    continue_final_message=True,
                    add_generation_prompt=False,
                )
            ]
        ),
        AddRequests([TokenizedRequest(2, [1, 2, 3], SamplingParams(stop="a", seed=-(2**63)))]),
        SubmitRequest(
            [SubmitItem(6, text="hi", priority=-(2**63)), SubmitItem(7, priority=2**63 - 1)]
        ),
        AddRequests([TokenizedRequest(8, [1], SamplingParams(), priority=-3)]),
        StepOutputs(
            [
                TokenOutput(3, [7], 4, 1, 2, "stop", "x", [logprob], counters={"a": 2}),
                TokenOutput(4, [], finish_reason="abort", error="boom", error_status=500),
            ]
        ),
    ]
    for msg in msgs:
        assert decode(encode(msg)) == msg


def test_sampling_params_cross_ipc_as_sent() -> None:
    """Decoding restores the fields as they were sent, without validating again (it was
    validated where it was built): even a value only the sender's checks could judge."""
    params = SamplingParams(max_tokens=None, stop=["a"], json_schema='{"type": "object"}')
    back = decode(encode(TokenizedRequest(1, [2], params))).params
    assert back == params and back.stop is not params.stop
    # Defaults left out on the wire come back as new objects (lists are not shared).
    x, y = (decode(encode(SamplingParams())) for _ in range(2))
    assert x == y == SamplingParams() and x.stop is not y.stop
    trusted = dataclasses.replace(params)  # a valid object...
    object.__setattr__(trusted, "temperature", -1.0)  # ...changed behind the checks' back
    assert decode(encode(trusted)).temperature == -1.0  # not re-validated on the way


def test_unregistered_objects_are_refused() -> None:
    @dataclasses.dataclass
    class NotAMessage:
        x: int = 0

    with pytest.raises(TypeError):
        encode(NotAMessage())


# ---------------------------------------------------------------- command line
def test_every_config_field_is_a_flag() -> None:
    parser = build_parser()
    flags = {opt for action in parser._actions for opt in action.option_strings}
    for name in option_names(EngineConfig):
        assert "--" + name.replace("_", "-") in flags, name
    for alias in ("--tp", "--model-path", "--host", "--port", "--shell", "--served-model-name"):
        assert alias in flags


def test_defaults_match_the_config() -> None:
    # from_kwargs: the core's defaults and every loaded extension's option group's.
    defaults = EngineConfig.from_kwargs()
    assert engine_config(build_parser().parse_args([])) == defaults
    assert dataclasses.replace(defaults, extensions=()) == EngineConfig()


def test_flags_reach_the_config() -> None:
    args = build_parser().parse_args(
        ["--model-path", "m", "--page-size", "16", "--tp", "2", "--disable-mixed-batch"]
        + ["--cache", "naive", "--cuda-graph-max-bs", "0", "--port", "8000"]
    )
    cfg = engine_config(args)
    assert (cfg.model, cfg.page_size, cfg.tp_size, cfg.disable_mixed_batch) == ("m", 16, 2, True)
    assert (cfg.cache, cfg.cuda_graph_max_bs, args.port) == ("naive", 0, 8000)


def test_bad_flag_values_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from minisgl.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--page-size", "0"])
    assert exit_info.value.code == 2
    assert "page_size" in capsys.readouterr().err


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
