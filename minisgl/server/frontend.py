"""The API server's side of IPC: submit requests, route outputs to their HTTP request, abort.

Each HTTP request becomes a `RequestGroup` (one sequence per choice). Outputs are routed by
request id to the group's queue; a group is forgotten as soon as all its sequences finished or
it is closed, so no per-request state outlives its HTTP request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from minisgl.ipc import sockets
from minisgl.ipc.messages import (
    AbortRequests,
    ControlReply,
    ControlRequest,
    SubmitItem,
    SubmitRequest,
    TextOutput,
    TextOutputs,
    TokenLogprob,
    encode,
)
from minisgl.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class ServiceUnavailable(RuntimeError):
    """The engine is gone (a child process died) or the server is shutting down."""


class Draining(ServiceUnavailable):
    """The server is shutting down gracefully: running requests finish, new ones are refused."""


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
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    def add(self, out: TextOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs or []
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = out.completion_tokens or self.completion_tokens
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        # Running totals; an error output carries zeros, so keep the largest seen.
        self.spec_verify_steps = max(self.spec_verify_steps, out.spec_verify_steps)
        self.spec_draft_tokens = max(self.spec_draft_tokens, out.spec_draft_tokens)
        self.spec_accepted_tokens = max(self.spec_accepted_tokens, out.spec_accepted_tokens)
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

    def __init__(self, frontend: Frontend, rids: list[int]) -> None:
        self.frontend = frontend
        self.rids = rids
        self.index = {rid: i for i, rid in enumerate(rids)}
        self.queue: asyncio.Queue[TextOutput] = asyncio.Queue()
        self.unfinished = set(rids)
        self.arrival = time.perf_counter()
        self.last_token_at: dict[int, float] = {}  # per sequence, for inter-token latency
        self.timer: asyncio.TimerHandle | None = None  # the request timeout, if any
        self.closed = False

    async def first(self) -> TextOutput:
        """The first output of any sequence (an error here means nothing was queued)."""
        return await self.queue.get()

    async def outputs(self, first: TextOutput | None = None) -> AsyncIterator[TextOutput]:
        """Outputs in arrival order until every sequence has finished."""
        pending = [first] if first is not None else []
        done: set[int] = set()
        while len(done) < len(self.rids):
            out = pending.pop() if pending else await self.queue.get()
            if out.finished:
                done.add(out.rid)
            yield out

    def close(self) -> None:
        """Forget the group; abort sequences that have not finished (client went away)."""
        if self.closed:
            return
        self.closed = True
        self.frontend.forget(self)


class Frontend:
    def __init__(
        self,
        addresses: sockets.IpcAddresses,
        metrics: ServerMetrics,
        request_timeout: float | None = None,
    ) -> None:
        self.addresses = addresses
        self.metrics = metrics
        self.request_timeout = request_timeout
        self.draining = False
        self.groups: dict[int, RequestGroup] = {}
        self.controls: dict[int, asyncio.Future[ControlReply]] = {}
        self.rids = itertools.count(1)
        self.cids = itertools.count(1)
        self.dead_reason: str | None = None
        self._recv_task: asyncio.Task[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        # Sending uses a plain socket: with no HWM a send never blocks, so aborts can be sent
        # from synchronous cleanup code (including while a request is being cancelled).
        self.sync_ctx = zmq.Context()
        self.to_worker = sockets.connect_push(self.sync_ctx, self.addresses.worker)
        self.async_ctx = zmq.asyncio.Context()
        self.inbox = sockets.bind_pull(self.async_ctx, self.addresses.frontend)  # type: ignore[arg-type]
        self._recv_task = asyncio.create_task(self._recv_loop())

    async def stop(self) -> None:
        self.dead_reason = self.dead_reason or "the server is shutting down"
        if self._recv_task is not None:
            self._recv_task.cancel()
        self.inbox.close()
        self.to_worker.close()
        self.async_ctx.term()
        self.sync_ctx.term()

    # ------------------------------------------------------------ requests
    def submit(self, items: list[SubmitItem]) -> RequestGroup:
        if self.dead_reason is not None:
            raise ServiceUnavailable(self.dead_reason)
        if self.draining:
            self.metrics.rejected.labels("shutting_down").inc()
            raise Draining("the server is shutting down and accepts no new requests")
        for item in items:
            item.rid = next(self.rids)
        try:
            payload = encode(SubmitRequest(items))
        except (OverflowError, TypeError, ValueError) as exc:
            # e.g. an integer beyond 64 bits that pydantic accepted: the client's mistake.
            raise ValueError(f"the request holds a value that is out of range: {exc}") from None
        group = RequestGroup(self, [item.rid for item in items])
        for rid in group.rids:
            self.groups[rid] = group
        self.to_worker.send(payload, copy=False)
        if self.request_timeout is not None and self.loop is not None:
            group.timer = self.loop.call_later(self.request_timeout, self._expire, group)
        return group

    def forget(self, group: RequestGroup) -> None:
        if group.timer is not None:
            group.timer.cancel()
        unfinished = sorted(group.unfinished)
        for rid in group.rids:
            self.groups.pop(rid, None)
        if unfinished and self.dead_reason is None:
            self.metrics.aborted_requests.inc(len(unfinished))
            sockets.send(self.to_worker, AbortRequests(unfinished))

    def _expire(self, group: RequestGroup) -> None:
        if group.closed or not group.unfinished:
            return
        timeout = self.request_timeout
        message = (
            f"the request exceeded the server's request timeout ({timeout:g}s) and was aborted"
        )
        n = self.abort_group(group, message, 504)
        self.metrics.server_aborts.labels("timeout").inc(n)

    def abort_group(self, group: RequestGroup, message: str, status: int) -> int:
        """End the group's unfinished sequences with an error output (what its HTTP response
        reports) and abort them in the scheduler, which frees their KV. Returns how many."""
        unfinished = sorted(group.unfinished)
        group.unfinished.clear()
        for rid in unfinished:
            self.groups.pop(rid, None)
            group.queue.put_nowait(
                TextOutput(rid, "", [], finish_reason="abort", error=message, error_status=status)
            )
        if unfinished and self.dead_reason is None:
            sockets.send(self.to_worker, AbortRequests(unfinished))
        return len(unfinished)

    # ------------------------------------------------------------ graceful shutdown
    def start_draining(self) -> None:
        self.draining = True

    async def wait_drained(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every live sequence to finish."""
        deadline = time.monotonic() + timeout
        while self.groups and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.groups

    def abort_all(self, message: str, status: int) -> int:
        groups = {id(g): g for g in self.groups.values()}.values()
        return sum(self.abort_group(g, message, status) for g in list(groups))

    @property
    def num_live_requests(self) -> int:
        return len(self.groups)

    # ------------------------------------------------------------ control
    async def control(self, kind: str, timeout: float) -> ControlReply:
        if self.dead_reason is not None:
            raise ServiceUnavailable(self.dead_reason)
        cid = next(self.cids)
        fut: asyncio.Future[ControlReply] = asyncio.get_running_loop().create_future()
        self.controls[cid] = fut
        sockets.send(self.to_worker, ControlRequest(cid, kind))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.controls.pop(cid, None)

    # ------------------------------------------------------------ receiving
    async def _recv_loop(self) -> None:
        while True:
            msg = await sockets.recv_async(self.inbox)  # type: ignore[arg-type]
            try:
                if isinstance(msg, TextOutputs):
                    now = time.perf_counter()
                    for out in msg.outputs:
                        self._route(out, now)
                elif isinstance(msg, ControlReply):
                    fut = self.controls.get(msg.cid)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
            except Exception:
                logger.exception("failed to route %s", type(msg).__name__)

    def _route(self, out: TextOutput, now: float) -> None:
        group = self.groups.get(out.rid)
        if group is None:
            return  # the HTTP request is gone (client disconnected); it was aborted
        self.metrics.observe_output(group, out, now)
        if out.finished:
            group.unfinished.discard(out.rid)
            self.groups.pop(out.rid, None)
        group.queue.put_nowait(out)

    def fail_all(self, reason: str) -> None:
        """A child process died: every waiting request gets an error now (thread-safe)."""
        if self.loop is None:
            self.dead_reason = reason
            return
        self.loop.call_soon_threadsafe(self._fail_all, reason)

    def _fail_all(self, reason: str) -> None:
        self.dead_reason = reason  # set first: nothing is sent to the dead engine
        self.abort_all(reason, 503)
        for fut in self.controls.values():
            if not fut.done():
                fut.set_exception(ServiceUnavailable(reason))


def make_items(
    prompts: list[Any], fields_for_choice: list[dict[str, Any]], **extra: Any
) -> list[SubmitItem]:
    """One SubmitItem per (prompt, choice), prompt-major: item i*n + j is prompt i, choice j."""
    items = []
    for prompt in prompts:
        for fields in fields_for_choice:
            item = SubmitItem(rid=0, params=fields, **extra)
            if isinstance(prompt, str):
                item.text = prompt
            elif prompt and isinstance(prompt[0], dict):
                item.messages = prompt
            else:
                item.input_ids = [int(t) for t in prompt]
            items.append(item)
    return items
