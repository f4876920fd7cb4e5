"""What the scheduler process does besides stepping requests: admission limits (the queue
limit, the context length), control requests (ping, stats, flush_cache, integrity), counts
of what only it sees (queue-full refusals, aborts by phase), and the leak guard: once idle
after work, every KV page must be free or evictable and every request row free."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from minisgl.engine.setup import trim_heap
from minisgl.ipc.messages import ControlReply, ControlRequest, JSONDict
from minisgl.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minisgl.scheduler.request import Req
    from minisgl.scheduler.scheduler import Scheduler
    from minisgl.tp.mirror import RankState
    from minisgl.tp.server_sync import RankSync

logger = logging.getLogger("minisgl.server.scheduler_process")

# The leak guard checks KV integrity whenever the scheduler has gone idle after doing work,
# at most this often (the check walks the whole prefix cache).
INTEGRITY_INTERVAL_S = 5.0
ABORT_PHASES = ("waiting", "prefill", "decode")


class LoopControl:
    """``send`` (rank 0's outbox; nothing on other ranks) carries the replies; ``live`` counts
    the requests the loop is serving."""

    def __init__(
        self,
        scheduler: Scheduler,
        state: RankState,
        sync: RankSync,
        send: Callable[[object], None],
        live: Callable[[], int],
    ) -> None:
        self.scheduler, self.state, self.sync = scheduler, state, sync
        self.send, self.live = send, live
        self.wait_for_idle: list[ControlRequest] = []
        self.max_queued: int | None = None  # --max-queued-requests (rank 0's, shared)
        self.rejected_queue_full = 0
        self.aborts = dict.fromkeys(ABORT_PHASES, 0)  # by where the request was
        # Leak guard state: whether anything ran since the last check, and when that was.
        self.dirty = False
        self.last_check = float("-inf")
        self.integrity_checks = 0
        self.integrity_violations = 0

    def overloaded(self, new: int) -> str | None:
        """Why ``new`` more sequences are refused (503), or None: when they would leave more
        than the limit waiting. Sequences that will take a free request slot at the next
        step do not count as waiting. An empty queue always accepts, so that a request with
        many choices is slow, never impossible."""
        waiting = len(self.scheduler.waiting)
        if self.max_queued is None or waiting == 0:
            return None
        if waiting + new - len(self.scheduler.kv.free_rows) <= self.max_queued:
            return None
        self.rejected_queue_full += 1
        return (
            f"the server is overloaded: {waiting} requests are already waiting "
            f"(limit {self.max_queued}); retry later"
        )

    def handle(self, msg: ControlRequest) -> None:
        if msg.kind == "ping":  # liveness (server/frontend.py): the loop is turning
            self.send(ControlReply(msg.cid, True))
        elif msg.kind == "stats":
            if self.sync.reads_inbox:  # a read of rank 0's state: no other rank is needed
                self.send(ControlReply(msg.cid, True, self.stats()))
        elif msg.kind in ("integrity", "flush_cache"):
            self.wait_for_idle.append(msg)
        else:
            self.send(ControlReply(msg.cid, False, {"error": f"unknown {msg.kind!r}"}))

    def on_idle(self) -> None:
        """Idle-time work changes no scheduler state, so on each rank it may run on that
        rank's own clock (the leak guard)."""
        for msg in self.wait_for_idle:
            if msg.kind == "flush_cache":
                ok = self.scheduler.flush_cache()  # every rank flushes: caches stay identical
                self.send(ControlReply(msg.cid, ok, self.stats()))
            else:
                self._integrity(msg.cid)
        self.wait_for_idle.clear()
        if self.dirty and time.monotonic() - self.last_check >= INTEGRITY_INTERVAL_S:
            self.check_integrity()
            trim_heap()

    def check_integrity(self) -> str | None:
        """Check this rank's KV state: the problem, or None. A violation is logged and
        counted; serving goes on."""
        self.dirty, self.last_check = False, time.monotonic()
        self.integrity_checks += 1
        try:
            self.scheduler.check_integrity()
            return None
        except Exception as exc:  # AssertionError, or the check itself tripping on bad state
            error = str(exc) or f"integrity check failed ({type(exc).__name__})"
        self.integrity_violations += 1
        s = self.scheduler
        logger.error(
            "KV leak detected (integrity violation #%d): %s; running=%d waiting=%d "
            "free_pages=%d evictable_pages=%d total_pages=%d",
            self.integrity_violations,
            error,
            len(s.running),
            len(s.waiting),
            s.kv.allocator.num_free_pages,
            s.kv.cache.evictable_pages,
            s.engine.pool.num_pages,
        )
        return error

    def _integrity(self, cid: int) -> None:
        """Every rank checks its own KV state; rank 0 answers for all of them, and fails the
        check too if the ranks no longer hold the same state (every step must agree)."""
        from minisgl.tp.mirror import report_problems

        own = self.check_integrity()
        reports = self.sync.gather({"rank": self.state.rank, "error": own, **self.state.summary()})
        if reports is None:
            return  # not rank 0
        error = own if len(reports) == 1 else "; ".join(report_problems(reports)) or None
        if error is not None and own is None:  # only another rank found it: count it here
            self.integrity_violations += 1
            logger.error("TP integrity violation: %s", error)
        data = self.stats()
        data["ok"], data["error"], data["live_requests"] = error is None, error, self.live()
        data["ranks"] = reports
        self.send(ControlReply(cid, error is None, data))

    def stats(self) -> JSONDict:
        s = self.scheduler
        stats = s.kv.cache.stats
        return {
            "running": len(s.running),
            "waiting": len(s.waiting),
            "free_pages": s.kv.allocator.num_free_pages,
            "evictable_pages": s.kv.cache.evictable_pages,
            "total_pages": s.engine.pool.num_pages,
            "page_size": s.page_size,
            "prefix_hit_rate": stats.hit_rate,
            "prefix_looked_up_tokens": stats.looked_up_tokens,
            "prefix_matched_tokens": stats.matched_tokens,
            "retractions": s.num_retractions,
            "priority_preemptions": s.num_priority_preemptions,
            **s.totals,  # what extensions count over the run (e.g. drafts verified)
            "integrity_checks": self.integrity_checks,
            "integrity_violations": self.integrity_violations,
            "rejected_queue_full": self.rejected_queue_full,
            **{f"aborts_{phase}": n for phase, n in self.aborts.items()},
        }


def fit_context(params: SamplingParams, prompt_len: int, context_length: int) -> SamplingParams:
    """``params`` with max_tokens None resolved to the room the prompt leaves ("as many as
    fit"); ValueError if an explicit max_tokens does not fit."""
    room = context_length - prompt_len
    if params.max_tokens is None:
        return params.with_max_tokens(max(1, room))
    if prompt_len < context_length and params.max_tokens > room:
        raise ValueError(
            f"this model's maximum context length is {context_length} tokens, but "
            f"{prompt_len + params.max_tokens} were requested ({prompt_len} in the prompt, "
            f"max_tokens={params.max_tokens} for the completion); reduce the prompt or max_tokens"
        )
    return params


def abort_phase(req: Req) -> str:
    """Where an aborted request was: queued (or retracted), still in prefill, or decoding."""
    from minisgl.scheduler.request import ReqState

    if req.state is ReqState.WAITING:
        return "waiting"
    return "prefill" if req.num_generated == 0 else "decode"
