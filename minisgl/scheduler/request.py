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
    error: str | None = None
    admit_order: int = 0
    priority: int = 0  # --schedule-policy priority: lower values are served first
    arrival: int = 0  # the scheduler's arrival counter: ties between equal priorities
    drafter: object | None = None  # speculative n-gram index over the request's tokens
    draft: list[int] = field(default_factory=list)  # n-gram tokens proposed for this step
    num_draft: int = 0  # draft tokens verified in this step (0: a plain decode)
    draft_len: int = 0  # leading tokens whose draft-model K/V is in the draft pool
    # Speculation totals (reported with the output): verify steps, drafted, accepted.
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    inflight: int = 0  # tokens sampled on the device whose values the host has not seen yet
    grammar: object | None = None  # structured output's matcher (scheduler/grammar.py)
    # Reasoning (grammar_after): the grammar applies once the output ends with these tokens;
    # () once it does (or from the start).
    grammar_wait: tuple[int, ...] = ()
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
