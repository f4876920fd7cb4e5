"""The IPC codec: messages between the processes round-trip as sent (sampling parameters
as a dataclass, not re-validated), trailing defaults are left out on the wire, and what is
not a registered message is refused."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from minisgl.ipc.codec import decode, encode, message
from minisgl.ipc.messages import (
    AddRequests,
    StepOutputs,
    SubmitItem,
    SubmitRequest,
    TextOutput,
    TextOutputs,
    TokenizedRequest,
    TokenLogprob,
    TokenOutput,
    TopLogprob,
)
from minisgl.sampling_params import SamplingParams

MSG = [{"role": "user", "content": "hi"}]


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


# ---------------------------------------------------------------- trailing defaults
@message
@dataclasses.dataclass
class _Probe:
    a: int
    b: int = 0
    c: list[int] = dataclasses.field(default_factory=list)
    d: str | None = None


def test_trailing_defaults_are_left_out_and_restored() -> None:
    full = encode(_Probe(1, 2, [3], "x"))
    short = encode(_Probe(1))
    assert len(short) < len(full)
    assert decode(short) == _Probe(1)
    assert decode(encode(_Probe(1, d="x"))) == _Probe(1, 0, [], "x")  # inner defaults kept
    # A value equal to its default but of another type is sent as it is.
    out = decode(encode(_Probe(1, False)))
    assert out.b is False
    # Each decoded message gets its own default list.
    x, y = decode(encode([_Probe(1), _Probe(2)]))
    assert x.c is not y.c


def test_decode_output_of_one_step() -> None:
    outs = [
        TextOutput(i, " t5", [5], 2100, 3, 2000, finish_reason="length" if i == 3 else None)
        for i in range(4)
    ]
    outs.append(TextOutput(9, "", [], logprobs=[TokenLogprob(5, -0.5)], error="boom"))
    msg = decode(encode(TextOutputs(outs)))
    assert msg == TextOutputs(outs)
    assert [o.finished for o in msg.outputs] == [False, False, False, True, False]


def test_plain_lists_and_foreign_extensions_pass_through() -> None:
    data = [[1, 2], [], [[3]], {"k": [4]}]
    assert decode(encode(data)) == data
    ext = msgpack.ExtType(7, b"raw")
    assert decode(msgpack.packb([ext])) == [ext]


def test_token_output_defaults_round_trip() -> None:
    out = TokenOutput(3, [7], 2100, 1, 2000)
    assert decode(encode(out)) == out
