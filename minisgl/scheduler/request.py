"""A request's state as the scheduler tracks it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from minisgl.sampling_params import SamplingParams


class ReqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Req:
    uid: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    state: ReqState = ReqState.WAITING
    row: int = -1  # page-table row while admitted
    kv_len: int = 0  # leading tokens whose K/V is in the pool
    alloc_len: int = 0  # token slots allocated in the row (a multiple of the page size)
    tree_node: object | None = None  # locked radix node covering [0, tree_len)
    tree_len: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    admitted_once: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched_stop: int | str | None = None
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # prompt_logprobs[i] is the logprob of prompt token i + 1 given the tokens before it.
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    admit_order: int = 0
    priority: int = 0  # --schedule-policy priority: lower values are served first
    arrival: int = 0  # the scheduler's arrival counter: ties between equal priorities
    inflight: int = 0  # tokens sampled on the device whose values the host has not seen yet
    # The request's constraint state, owned by the ConstraintBackend (scheduler/plugins.py).
    constraint: object | None = None
    # Per-request totals that extensions keep (e.g. draft tokens verified), reported with
    # the output.
    counters: dict[str, int] = field(default_factory=dict)
    stop_regex: object | None = None  # the output text's stop_regex matcher (scheduler/stop.py)
    arrived: float = field(default_factory=time.monotonic)  # added to the scheduler
    queue_time: float = 0.0  # seconds from arrival to first admission

    @property
    def num_known(self) -> int:
        """Tokens whose ids the host knows."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        """All tokens, including those sampled by a batch still in flight."""
        return len(self.prompt_ids) + len(self.output_ids) + self.inflight

    @property
    def num_generated(self) -> int:
        return len(self.output_ids) + self.inflight

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def pending(self) -> int:
        """Tokens still to be fed to the model before the next sample."""
        return self.num_tokens - self.kv_len

    @property
    def finished(self) -> bool:
        return self.state is ReqState.FINISHED


@dataclass
class Row:
    """One request's part of a step."""

    req: Req
    extend: int  # new tokens it feeds (for a decode row: 1 plus its drafts)
    samples: bool  # its last new token samples the request's next token
    drafts: int = 0  # draft tokens it verifies (a decode row of a speculating request)
