"""Messages between the API server, the tokenizer/detokenizer worker and the scheduler.

Routes (every socket is PUSH -> PULL, so each process reads one inbox):

    API server --SubmitRequest/AbortRequests/ControlRequest--> worker
    worker     --AddRequests/AbortRequests/ControlRequest-->   scheduler (rank 0)
    scheduler  --StepOutputs/ControlReply-->                   worker
    worker     --TextOutputs/ControlReply-->                   API server

Aborts and control requests travel through the worker on purpose: the worker forwards in
arrival order, so an abort can never overtake the request it cancels.

Encoding: msgpack, with each message dataclass packed as an array: a small extension value
naming its class, then its field values in declaration order (compact, nested messages
round-trip, and one packer call does a whole message). Trailing fields still at their
defaults are left out (the constructor fills them in): most per-token outputs carry 5 of
their 17 fields, and a step sends one per running request.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
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
    chat_template_kwargs: dict[str, Any] | None = None  # chat: passed to the template
    continue_final_message: bool = False  # chat: the last (assistant) message stays open
    add_generation_prompt: bool = True  # chat
    # SamplingParams fields; max_tokens None means "up to the context length".
    params: dict[str, Any] = field(default_factory=dict)
    return_prompt_text: bool = False  # completions echo
    return_prompt_tokens: bool = False  # echo + logprobs: the prompt's token strings
    tools: list[dict[str, Any]] | None = None  # chat: passed to the template
    priority: int = 0  # --schedule-policy priority: lower values are served first


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
    kind: str  # "flush_cache" | "integrity" | "stats" | "ping"


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
    priority: int = 0


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
    queue_time: float = 0.0  # seconds from reaching the scheduler to first admission


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
    queue_time: float = 0.0  # seconds from reaching the scheduler to first admission

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@message
@dataclass
class TextOutputs:
    outputs: list[TextOutput]


# ---------------------------------------------------------------- codec
_NO_DEFAULT = object()


_Layout = tuple[Callable[[Any], tuple[Any, ...]], tuple[Any, ...], msgpack.ExtType]
_LAYOUTS: dict[type, _Layout] = {}


def _layout(cls: type) -> _Layout:
    """A getter of the class's field values (one C call), each field's default, and the tag
    that names the class on the wire; built once per class."""
    layout = _LAYOUTS.get(cls)
    if layout is None:
        layout = _LAYOUTS[cls] = _make_layout(cls)
    return layout


def _make_layout(cls: type) -> _Layout:
    fs = fields(cls)
    getter = operator.attrgetter(*(f.name for f in fs))
    defaults = tuple(
        f.default
        if f.default is not MISSING
        else f.default_factory()
        if f.default_factory is not MISSING
        else _NO_DEFAULT
        for f in fs
    )
    tag = msgpack.ExtType(_EXT_MESSAGE, cls.__name__.encode())
    if len(fs) == 1:  # attrgetter of one name returns the value itself, not a tuple
        return (lambda obj: (getter(obj),)), defaults, tag
    return getter, defaults, tag


def _default(obj: Any) -> Any:
    """A message as the array [tag, *values]: the tag (an extension value naming the class)
    lets the decoder rebuild it, and the values are packed inline by the same packer."""
    cls = type(obj)
    if _REGISTRY.get(cls.__name__) is not cls:
        if hasattr(cls, "__dataclass_fields__"):
            raise TypeError(f"{cls.__name__} is not a registered IPC message")
        raise TypeError(f"cannot send {cls.__name__} over IPC")
    getter, defaults, tag = _layout(cls)
    values = getter(obj)
    n = len(values)
    # Same type as well as equal: False must not be dropped for a default of 0.
    while n and type(values[n - 1]) is type(defaults[n - 1]) and values[n - 1] == defaults[n - 1]:
        n -= 1
    return [tag, *values[:n]]


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _EXT_MESSAGE:
        return msgpack.ExtType(code, data)
    return _REGISTRY[data.decode()]


def _list_hook(items: list[Any]) -> Any:
    # Only a message's array starts with a class (what _ext_hook makes of a tag).
    if items and type(items[0]) is type:
        return items[0](*items[1:])
    return items


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(
        data, ext_hook=_ext_hook, list_hook=_list_hook, raw=False, strict_map_key=False
    )


def encode(msg: Any) -> bytes:
    return _pack(msg)


def decode(data: bytes) -> Any:
    return _unpack(data)
