"""The API server's side of IPC: submit requests, route outputs to their HTTP request, abort.

Each HTTP request becomes a `RequestGroup` (one sequence per choice). Outputs are routed by
request id to the group's queue; a group is forgotten as soon as all its sequences finished or
it is closed, so no per-request state outlives its HTTP request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq

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
    decode,
    encode,
)
from minisgl.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

# Liveness (see Frontend.stalled): the scheduler answers a "ping" control message from its
# loop, between steps. A ping unanswered for the health timeout makes /health 503. The default
# is generous because one step can legitimately block the loop for long: a huge prefill, or
# the first use of a kernel shape compiling (Triton JIT) on a GPU; a load balancer that pulls
# a busy but working server out of rotation does more harm than one that notices a hang late.
DEFAULT_HEALTH_TIMEOUT_S = 60.0
PING_INTERVAL_S = 5.0  # at most; a quarter of the timeout when that is shorter


class ServiceUnavailable(RuntimeError):
    """The engine is gone (a child process died) or the server is shutting down."""


class Draining(ServiceUnavailable):
    """The server is shutting down gracefully: running requests finish, new ones are refused."""


class ClientGone(Exception):
    """The HTTP client disconnected before its response was complete."""


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
        self.frontend.forget(self)


class Frontend:
    def __init__(
        self,
        addresses: sockets.IpcAddresses,
        metrics: ServerMetrics,
        request_timeout: float | None = None,
        health_timeout: float = DEFAULT_HEALTH_TIMEOUT_S,
    ) -> None:
        self.addresses = addresses
        self.metrics = metrics
        self.request_timeout = request_timeout
        self.health_timeout = health_timeout
        self.ping_interval = min(PING_INTERVAL_S, health_timeout / 4)
        # When the oldest ping not yet answered was sent (None: the last one was answered),
        # and when outputs last arrived (for /health_generate): monotonic seconds.
        self.unanswered_since: float | None = None
        self.last_output_at = float("-inf")
        self._heartbeat_task: asyncio.Task[None] | None = None
        self.draining = False
        self.groups: dict[int, RequestGroup] = {}
        self.named: dict[str, RequestGroup] = {}  # by the id the client sees
        self.controls: dict[int, asyncio.Future[ControlReply]] = {}
        self.rids = itertools.count(1)
        self.cids = itertools.count(1)
        self.dead_reason: str | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._inbox_fd: int | None = None

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        # Plain sockets: with no HWM a send never blocks, so aborts can be sent from
        # synchronous cleanup code (including while a request is being cancelled).
        self.sync_ctx = zmq.Context()
        self.to_worker = sockets.connect_push(self.sync_ctx, self.addresses.worker)
        self.inbox = sockets.bind_pull(self.sync_ctx, self.addresses.frontend)
        # Outputs are routed straight from the reader callback (one hop to the streams), and
        # also whenever a request is submitted: under a burst of arriving requests the loop
        # runs hundreds of handlers between polls, and outputs waited behind all of them (a
        # 512-request burst routed no output for 400 ms; zmq.asyncio did the same).
        fd = self.inbox.getsockopt(zmq.FD)
        assert isinstance(fd, int)
        self._inbox_fd = fd
        self.loop.add_reader(fd, self._drain_inbox)
        self._drain_inbox()  # the descriptor signals edges: take what came before the reader
        self._heartbeat_task = self.loop.create_task(self._heartbeat())

    async def stop(self) -> None:
        self.dead_reason = self.dead_reason or "the server is shutting down"
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat_task
            self._heartbeat_task = None
        if self.loop is not None and self._inbox_fd is not None:
            self.loop.remove_reader(self._inbox_fd)
            self._inbox_fd = None
        self.inbox.close()
        self.to_worker.close()
        self.sync_ctx.term()

    # ------------------------------------------------------------ requests
    def submit(self, items: list[SubmitItem], probe: bool = False) -> RequestGroup:
        if not items:  # a group of no requests would never finish: its reply would hang
            raise ValueError("the request holds no prompt")
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
        group.probe = probe
        for rid in group.rids:
            self.groups[rid] = group
        self.to_worker.send(payload, copy=False)
        if self.request_timeout is not None and self.loop is not None:
            group.timer = self.loop.call_later(self.request_timeout, self._expire, group)
        self._drain_inbox()  # see start(): other requests' outputs must not wait for a burst
        return group

    def name(self, group: RequestGroup, name: str) -> None:
        """Let /abort_request find the group by the id its response carries."""
        group.name = name
        self.named[name] = group

    def forget(self, group: RequestGroup) -> None:
        if group.timer is not None:
            group.timer.cancel()
        if group.name is not None and self.named.get(group.name) is group:
            del self.named[group.name]
        unfinished = sorted(group.unfinished)
        for rid in group.rids:
            self.groups.pop(rid, None)
        if unfinished and self.dead_reason is None:
            if not group.probe:
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

    def abort_group(self, group: RequestGroup, message: str | None, status: int) -> int:
        """End the group's unfinished sequences with an error output (what its HTTP response
        reports) and abort them in the scheduler, which frees their KV. Returns how many.
        ``message`` None (a client's /abort_request): no error, the sequences just finish
        with finish_reason "abort" and what they had generated."""
        unfinished = sorted(group.unfinished)
        group.unfinished.clear()
        error_status = status if message is not None else 0
        for rid in unfinished:
            self.groups.pop(rid, None)
            group.queue.put_nowait(
                TextOutput(
                    rid, "", [], finish_reason="abort", error=message, error_status=error_status
                )
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

    def abort_named(self, name: str) -> int:
        """A client's /abort_request for one request: how many sequences it ended."""
        group = self.named.get(name)
        return self.abort_group(group, None, 200) if group is not None else 0

    def abort_all(self, message: str | None, status: int) -> int:
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

    # ------------------------------------------------------------ liveness
    async def _heartbeat(self) -> None:
        """Ping the scheduler (through the tokenizer worker: the whole request path) every
        ``ping_interval`` seconds, one ping in flight at a time. A ping still unanswered after
        the health timeout is sent again (its late answer is dropped) but the stall is dated
        from the first one, so a hung loop stays unhealthy until it answers."""
        while self.dead_reason is None:
            if self.unanswered_since is None:
                self.unanswered_since = time.monotonic()
            try:
                await self.control("ping", self.health_timeout)
            except asyncio.TimeoutError:
                continue
            except ServiceUnavailable:
                return
            self.unanswered_since = None
            await asyncio.sleep(self.ping_interval)

    def stalled(self) -> str | None:
        """Why the engine looks hung (a ping unanswered for longer than the health timeout),
        or None. Cheap: reads what the heartbeat recorded."""
        since = self.unanswered_since
        if since is None:
            return None
        waited = time.monotonic() - since
        if waited <= self.health_timeout:
            return None
        return (
            f"the scheduler has not answered a liveness ping for {waited:.0f}s "
            f"(health timeout {self.health_timeout:g}s): it looks hung"
        )

    # ------------------------------------------------------------ receiving
    def _drain_inbox(self) -> None:
        """Route every message that has arrived; never waits. Reading until the socket is
        empty is what its edge-signalling descriptor requires."""
        if self._inbox_fd is None:
            return  # stopped
        while True:
            try:
                data = self.inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._handle(decode(data.bytes))
            except Exception:
                logger.exception("failed to handle a message from the worker")

    def _handle(self, msg: object) -> None:
        if isinstance(msg, TextOutputs):
            self.last_output_at = time.monotonic()
            now = time.perf_counter()
            for out in msg.outputs:
                self._route(out, now)
        elif isinstance(msg, ControlReply):
            fut = self.controls.get(msg.cid)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def _route(self, out: TextOutput, now: float) -> None:
        group = self.groups.get(out.rid)
        if group is None:
            return  # the HTTP request is gone (client disconnected); it was aborted
        if not group.probe:
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
                # Already checked to be ints (CompletionRequest.prompts, pydantic): copy only.
                item.input_ids = list(prompt)
            items.append(item)
    return items
