"""Messages between the API server, the tokenizer/detokenizer worker and the scheduler.

Routes (every socket is PUSH -> PULL, so each process reads one inbox):

    API server --SubmitRequest/AbortRequests/ControlRequest--> worker
    worker     --AddRequests/AbortRequests/ControlRequest-->   scheduler (rank 0)
    scheduler  --StepOutputs/ControlReply-->                   worker
    worker     --TextOutputs/ControlReply-->                   API server

Aborts and control requests travel through the worker on purpose: the worker forwards in
arrival order, so an abort can never overtake the request it cancels.

Encoding: msgpack, with each message dataclass packed as an extension type holding its class
name and its field values in declaration order (compact, and nested messages round-trip).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import msgpack

_EXT_MESSAGE = 1
_REGISTRY: dict[str, type] = {}


def message(cls: type) -> type:
    """Register a dataclass so that it can be sent over IPC."""
    _REGISTRY[cls.__name__] = cls
    return cls


# ---------------------------------------------------------------- API server -> worker
@message
@dataclass
class SubmitItem:
    """One sequence to generate (one choice of one prompt)."""

    rid: int
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # chat: rendered with the chat template
    # SamplingParams fields; max_tokens None means "up to the context length".
    params: dict[str, Any] = field(default_factory=dict)
    return_prompt_text: bool = False  # completions echo
    return_prompt_tokens: bool = False  # echo + logprobs: the prompt's token strings


@message
@dataclass
class SubmitRequest:
    """All sequences of one HTTP request; validated as a whole, queued all or none."""

    items: list[SubmitItem]


@message
@dataclass
class AbortRequests:
    rids: list[int]


@message
@dataclass
class ControlRequest:
    cid: int
    kind: str  # "flush_cache" | "integrity" | "stats"


@message
@dataclass
class ControlReply:
    cid: int
    ok: bool
    data: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- worker -> scheduler
@message
@dataclass
class TokenizedRequest:
    rid: int
    input_ids: list[int]
    params: dict[str, Any]


@message
@dataclass
class AddRequests:
    """Queued all or none (the scheduler validates every request first)."""

    reqs: list[TokenizedRequest]


# ---------------------------------------------------------------- scheduler -> worker
@message
@dataclass
class TopLogprob:
    token_id: int
    logprob: float
    token: str = ""  # filled in by the worker


@message
@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[TopLogprob] = field(default_factory=list)
    token: str = ""  # filled in by the worker


@message
@dataclass
class TokenOutput:
    """One request's progress in one scheduler step."""

    rid: int
    new_ids: list[int]
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched_stop: int | str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per new id, when requested
    # echo + logprobs: prompt tokens 1.. with their logprobs (first output only)
    prompt_logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    error_status: int = 0  # HTTP status for the error: 400 bad request, 500 internal
    # speculation totals so far: verify steps, draft tokens verified, drafts accepted
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


@message
@dataclass
class StepOutputs:
    """Everything one scheduler step produced, for all requests at once."""

    outputs: list[TokenOutput]


# ---------------------------------------------------------------- worker -> API server
@message
@dataclass
class TextOutput:
    rid: int
    text: str  # new text since the previous output (stop strings never included)
    token_ids: list[int]
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_text: str | None = None  # first output only, when asked for
    prompt_token_strs: list[str] | None = None  # first output only, when asked for
    prompt_logprobs: list[TokenLogprob] | None = None  # first output only, when asked for
    error: str | None = None
    error_status: int = 0
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@message
@dataclass
class TextOutputs:
    outputs: list[TextOutput]


# ---------------------------------------------------------------- codec
def _default(obj: Any) -> Any:
    if is_dataclass(obj) and not isinstance(obj, type):
        name = type(obj).__name__
        if name not in _REGISTRY:
            raise TypeError(f"{name} is not a registered IPC message")
        values = [getattr(obj, f.name) for f in fields(obj)]
        return msgpack.ExtType(_EXT_MESSAGE, _pack([name, *values]))
    raise TypeError(f"cannot send {type(obj).__name__} over IPC")


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _EXT_MESSAGE:
        return msgpack.ExtType(code, data)
    name, *values = _unpack(data)
    return _REGISTRY[name](*values)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


def encode(msg: Any) -> bytes:
    return _pack(msg)


def decode(data: bytes) -> Any:
    return _unpack(data)
