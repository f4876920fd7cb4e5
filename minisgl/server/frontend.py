"""The API server's side of IPC: submit requests, route outputs to their HTTP request, abort.

Each HTTP request becomes a `RequestGroup` (one sequence per choice, request_group.py).
Outputs are routed by request id to the group's queue; a group is forgotten as soon as all
its sequences finished or it is closed, so no per-request state outlives its HTTP request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time

import zmq

from minisgl.ipc import sockets
from minisgl.ipc.codec import decode, encode
from minisgl.ipc.messages import (
    AbortRequests,
    ControlReply,
    ControlRequest,
    SubmitItem,
    SubmitRequest,
    TextOutput,
    TextOutputs,
)
from minisgl.server.errors import Draining, ServiceUnavailable
from minisgl.server.liveness import DEFAULT_HEALTH_TIMEOUT_S, Heartbeat
from minisgl.server.observers import Observers
from minisgl.server.request_group import RequestGroup

logger = logging.getLogger(__name__)


class Frontend:
    def __init__(
        self,
        addresses: sockets.IpcAddresses,
        observers: Observers | None = None,
        request_timeout: float | None = None,
        health_timeout: float = DEFAULT_HEALTH_TIMEOUT_S,
    ) -> None:
        self.addresses = addresses
        self.observers = observers or Observers()
        self.request_timeout = request_timeout
        self.health_timeout = health_timeout
        self.heartbeat = Heartbeat(lambda timeout: self.control("ping", timeout), health_timeout)
        # When outputs last arrived (for /health_generate): monotonic seconds.
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
        alive = lambda: self.dead_reason is None  # noqa: E731
        self._heartbeat_task = self.loop.create_task(self.heartbeat.run(alive))

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
            self.observers.on_rejected("shutting_down")
            raise Draining("the server is shutting down and accepts no new requests")
        for item in items:
            item.rid = next(self.rids)
        try:
            payload = encode(SubmitRequest(items))
        except (OverflowError, TypeError, ValueError) as exc:
            # e.g. an integer beyond 64 bits that pydantic accepted: the client's mistake.
            raise ValueError(f"the request holds a value that is out of range: {exc}") from None
        group = RequestGroup(self.forget, [item.rid for item in items])
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
                self.observers.on_aborted("client_gone", len(unfinished))
            sockets.send(self.to_worker, AbortRequests(unfinished))

    def _expire(self, group: RequestGroup) -> None:
        if group.closed or not group.unfinished:
            return
        timeout = self.request_timeout
        message = (
            f"the request exceeded the server's request timeout ({timeout:g}s) and was aborted"
        )
        n = self.abort_group(group, message, 504)
        self.observers.on_aborted("timeout", n)

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

    def stalled(self) -> str | None:
        """Why the engine looks hung, or None (see liveness.py)."""
        return self.heartbeat.stalled()

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
            self.observers.on_output(group, out, now)
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
