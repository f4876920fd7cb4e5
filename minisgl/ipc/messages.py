"""Messages between the API server, the tokenizer/detokenizer worker and the scheduler.

Routes (every socket is PUSH -> PULL, so each process reads one inbox):

    API server --SubmitRequest/AbortRequests/ControlRequest--> worker
    worker     --AddRequests/AbortRequests/ControlRequest-->   scheduler (rank 0)
    scheduler  --StepOutputs/ControlReply-->                   worker
    worker     --TextOutputs/ControlReply-->                   API server

Aborts and control requests travel through the worker on purpose: the worker forwards in
arrival order, so an abort can never overtake the request it cancels.

Encoding: see codec.py (`SamplingParams` crosses as a dataclass too, not validated again).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.ipc.codec import checked_value, message
from minisgl.sampling_params import SamplingParams

# JSON-like values that cross IPC as they are (chat messages, template arguments, stats).
JSONDict = dict[str, object]

checked_value(SamplingParams)


# ---------------------------------------------------------------- API server -> worker
@message
@dataclass
class SubmitItem:
    """One sequence to generate (one choice of one prompt)."""

    rid: int
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[JSONDict] | None = None  # chat: rendered with the chat template
    chat_template_kwargs: JSONDict | None = None  # chat: passed to the template
    continue_final_message: bool = False  # chat: the last (assistant) message stays open
    add_generation_prompt: bool = True  # chat
    # max_tokens None means "up to the context length" (the scheduler process resolves it).
    params: SamplingParams = field(default_factory=SamplingParams)
    return_prompt_text: bool = False  # completions echo
    return_prompt_tokens: bool = False  # echo + logprobs: the prompt's token strings
    tools: list[JSONDict] | None = None  # chat: passed to the template
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
    data: JSONDict = field(default_factory=dict)


# ---------------------------------------------------------------- worker -> scheduler
@message
@dataclass
class TokenizedRequest:
    rid: int
    input_ids: list[int]
    params: SamplingParams
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
    queue_time: float = 0.0  # seconds from reaching the scheduler to first admission
    # Running totals that extensions keep per request (e.g. speculation's verify steps), by
    # name; empty when none has anything to count. Last, so that an empty one is not sent.
    counters: dict[str, int] = field(default_factory=dict)


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
    queue_time: float = 0.0  # seconds from reaching the scheduler to first admission
    counters: dict[str, int] = field(default_factory=dict)  # as TokenOutput's

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@message
@dataclass
class TextOutputs:
    outputs: list[TextOutput]
