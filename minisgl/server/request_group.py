"""One HTTP request's sequences (one per choice) and what they produced.

A `RequestGroup` is the queue its outputs arrive on (routed there by the `Frontend`); a
`SequenceResult` accumulates one sequence's outputs for the response.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from typing_extensions import TypeIs

from minisgl.ipc.messages import JSONDict, SubmitItem, TextOutput, TokenLogprob
from minisgl.sampling_params import SamplingParams
from minisgl.server.errors import ClientGone


@dataclass
class SequenceResult:
    """Everything one sequence (choice) produced, accumulated from its outputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    prompt_text: str | None = None
    prompt_token_strs: list[str] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    error_status: int = 0
    counters: dict[str, int] = field(default_factory=dict)  # extensions' running totals

    def add(self, out: TextOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs or []
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = out.completion_tokens or self.completion_tokens
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        # Running totals; an error output carries none, so keep the largest seen.
        for name, total in out.counters.items():
            self.counters[name] = max(self.counters.get(name, 0), total)
        if out.prompt_text is not None:
            self.prompt_text = out.prompt_text
        if out.prompt_token_strs is not None:
            self.prompt_token_strs = out.prompt_token_strs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finish_reason is not None:
            self.finish_reason, self.matched_stop = out.finish_reason, out.matched_stop
            self.error, self.error_status = out.error, out.error_status


class RequestGroup:
    """The sequences of one HTTP request and the queue their outputs arrive on."""

    def __init__(self, forget: Callable[[RequestGroup], None] | None, rids: list[int]) -> None:
        self.forget = forget  # the frontend's: stop routing to the group, abort what is left
        self.rids = rids
        self.index = {rid: i for i, rid in enumerate(rids)}
        # None on the queue: the client disconnected (client_gone), whoever is waiting stops.
        self.queue: asyncio.Queue[TextOutput | None] = asyncio.Queue()
        self.gone = False
        self.unfinished = set(rids)
        self.arrival = time.perf_counter()
        self.last_token_at: dict[int, float] = {}  # per sequence, for inter-token latency
        self.timer: asyncio.TimerHandle | None = None  # the request timeout, if any
        self.probe = False  # a /health_generate request: kept out of the metrics
        self.closed = False
        self.name: str | None = None  # the id the client sees (for /abort_request)

    async def first(self) -> TextOutput:
        """The first output of any sequence (an error here means nothing was queued).
        Awaited by the request's own task: the output wakes it directly, one event-loop
        pass after it is routed (under a burst of arriving requests every extra hop through
        another task waits a whole pass of request handlers)."""
        out = await self.queue.get()
        if out is None:
            raise ClientGone()
        return out

    def client_gone(self) -> None:
        """The client disconnected: wake whoever waits for outputs, so that it stops."""
        if not self.gone:
            self.gone = True
            self.queue.put_nowait(None)

    async def outputs(self, first: TextOutput | None = None) -> AsyncIterator[TextOutput]:
        """Outputs in arrival order until every sequence has finished."""
        async for batch in self.batches(first):
            for out in batch:
                yield out

    async def batches(self, first: TextOutput | None = None) -> AsyncIterator[list[TextOutput]]:
        """Outputs in arrival order until every sequence has finished, a batch per wake-up:
        each batch is everything queued by then. A stream that fell behind (the event loop
        was busy) catches up with one write instead of one per output."""
        pending = [first] if first is not None else []
        done: set[int] = set()
        while len(done) < len(self.rids):
            got = pending.pop() if pending else await self.queue.get()
            batch: list[TextOutput] = []
            while got is not None:
                batch.append(got)
                if got.finished:
                    done.add(got.rid)
                if len(done) == len(self.rids) or self.queue.empty():
                    break
                got = self.queue.get_nowait()
            if batch:
                yield batch
            if got is None:  # the client is gone
                return

    def close(self) -> None:
        """Forget the group; abort sequences that have not finished (client went away)."""
        if self.closed:
            return
        self.closed = True
        if self.forget is not None:
            self.forget(self)


# A prompt as the routes pass it on: text, token ids, or a chat conversation.
Prompt = str | list[int] | list[JSONDict]


def make_items(
    prompts: Sequence[Prompt], choices: Sequence[SamplingParams], base: SubmitItem | None = None
) -> list[SubmitItem]:
    """One SubmitItem per (prompt, choice), prompt-major: item i*n + j is prompt i, choice j;
    each a copy of ``base`` (the fields every item shares) with its prompt and params."""
    base = base or SubmitItem(rid=0)
    items = []
    for prompt in prompts:
        for params in choices:
            item = copy.copy(base)
            item.params = params
            if isinstance(prompt, str):
                item.text = prompt
            elif _is_conversation(prompt):
                item.messages = prompt
            else:
                # Already checked to be ints (CompletionRequest.prompts, pydantic): copy only.
                item.input_ids = list(prompt)
            items.append(item)
    return items


def _is_conversation(prompt: list[int] | list[JSONDict]) -> TypeIs[list[JSONDict]]:
    return bool(prompt) and isinstance(prompt[0], dict)
