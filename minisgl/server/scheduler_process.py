"""The scheduler process: a loop around `Scheduler` that talks ZMQ.

Each iteration: take every queued message (blocking only when there is nothing to run), apply
them, run one step, and send one `StepOutputs` with the new tokens of every request that
progressed. Per-request failures become error outputs for that request; a failing step aborts
the requests that were running and the loop goes on (with one rank; see below).

Tensor parallelism: each rank runs this loop in its own process (`scheduler-tp{r}`). Only rank
0 owns sockets; each iteration it hands what it read to every rank (`RankSync.exchange`), so
all ranks apply the same messages in the same order, build identical batches and sample
identical tokens; only rank 0 sends outputs and replies. Everything that changes scheduler
state follows from the exchanged messages alone: wall-clock decisions (request timeouts,
shutdown drains) are made by the API server and arrive as aborts, the queue limit reads the
scheduler's own (identical) state, and idle-time work changes no state. When rank 0's loop
ends it releases the other ranks (`RankSync.stop`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from minisgl.config import EngineConfig
from minisgl.distributed.topology import Topology
from minisgl.ipc import sockets
from minisgl.ipc.child import (
    freeze_startup_heap,
    parent_alive,
    run_child,
    setup_child,
    startup_report,
)
from minisgl.ipc.messages import (
    AbortRequests,
    AddRequests,
    ControlReply,
    ControlRequest,
    StepOutputs,
    TokenOutput,
)
from minisgl.sampling_params import SamplingParams
from minisgl.scheduler.outputs import error_output, token_output
from minisgl.scheduler.stop import LazyDecoder, StopStringDecoder

if TYPE_CHECKING:
    from minisgl.scheduler.request import Req

# torch and the engine are imported inside the child only: the server process imports this
# module just to name run_scheduler as the spawn target, and should stay light.

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 500  # an idle scheduler wakes this often to check on its parent
# The leak guard checks KV integrity whenever the scheduler has gone idle after doing work,
# at most this often (the check walks the whole prefix cache).
INTEGRITY_INTERVAL_S = 5.0


@dataclass(frozen=True)
class SchedulerArgs:
    config: EngineConfig
    addresses: sockets.IpcAddresses
    tokenizer_copy_dir: str  # written by the tokenizer worker (see tokenizer/worker.py)
    parent_pid: int
    tp_rank: int = 0
    log_level: str = "info"
    max_queued_requests: int | None = None  # None: queue without limit


def run_scheduler(args: SchedulerArgs, report_queue: Any) -> None:
    """Entry point of the scheduler process (spawned)."""
    setup_child(args.log_level)
    run_child(lambda: _serve(args, report_queue))


def _serve(args: SchedulerArgs, report_queue: Any) -> None:
    with startup_report(f"scheduler-tp{args.tp_rank}", report_queue) as ready:
        from minisgl.distributed import TPInfo
        from minisgl.distributed.group import share_cpu_threads
        from minisgl.engine.engine import Engine, pick_device

        tp = TPInfo(args.tp_rank, args.config.tp_size)
        share_cpu_threads(args.config, pick_device(args.config.device))
        engine = Engine(args.config, tp)  # with TP, joins the ranks' process groups
        loop = SchedulerLoop(engine, args)
        if tp.size > 1 and tp.is_primary:
            # Leave the loop on SIGTERM instead of dying, so that rank 0 releases the other
            # ranks (here and on other nodes) and they exit cleanly; Runtime.shutdown stops
            # rank 0 first for that reason.
            signal.signal(signal.SIGTERM, lambda signum, frame: loop.stop())
        ready(
            {
                "context_length": engine.context_length,
                "vocab_size": engine.model_config.vocab_size,
                "num_pages": engine.pool.num_pages,
                "page_size": args.config.page_size,
                "model_path": str(engine.resolved.path),
                "device": str(engine.device),
                "speculative_algorithm": _speculative_algorithm(args.config),
            }
        )
        freeze_startup_heap()
        loop.run()
    if tp.size > 1:
        # Leave gloo/NCCL before the interpreter exits: tearing down a live group at exit
        # can abort the process ("terminate called without an active exception").
        from minisgl.tp import leave_tp_group

        leave_tp_group()


class SchedulerLoop:
    def __init__(self, engine: Any, args: SchedulerArgs) -> None:
        from minisgl.scheduler.scheduler import Scheduler
        from minisgl.tp.mirror import RankState
        from minisgl.tp.server_sync import RankSync

        self.engine = engine
        self.parent_pid = args.parent_pid
        # With TP these are collectives: every rank builds its loop at startup. The ranks
        # must schedule alike: the same engine flags (but node_rank), rank 0's queue limit
        # (a server flag the other nodes need not be given).
        self.sync = RankSync(engine.tp)
        self.sync.require_same(dataclasses.replace(args.config, node_rank=0), "engine flags")
        self.max_queued = self.sync.share(args.max_queued_requests)
        self.decoder = server_decoder(engine, args.config, args.tokenizer_copy_dir)
        self.scheduler = Scheduler(engine, decode=self.decoder)
        # Steps and aborts go through it: it folds what each step produced into a digest,
        # which /debug/integrity compares across the ranks.
        self.state = RankState(self.scheduler, engine.tp.rank)
        self.context_length = self.scheduler.context_length
        self.ctx = zmq.Context()
        self.inbox: zmq.Socket[Any] | None = None
        self.outbox: zmq.Socket[Any] | None = None
        if self.sync.reads_inbox:
            self.inbox = sockets.bind_pull(self.ctx, args.addresses.scheduler)
            self.outbox = sockets.connect_push(self.ctx, args.addresses.worker)
        self.live: dict[int, Req] = {}
        self.reported: dict[int, int] = {}  # output tokens already sent, per request
        self.wait_for_idle: list[ControlRequest] = []
        self.keep_running = True  # cleared by stop() (in-process use, e.g. tests)
        self.rejected_queue_full = 0
        self.aborts = dict.fromkeys(("waiting", "prefill", "decode"), 0)  # by phase
        # Leak guard state: whether anything ran since the last check, and when that was.
        self.dirty = False
        self.last_check = float("-inf")
        self.integrity_checks = 0
        self.integrity_violations = 0

    # ------------------------------------------------------------ loop
    def run(self) -> None:
        try:
            self._loop()
            self._release_ranks()
        finally:
            # Close the sockets explicitly: a context with open sockets would block exit.
            self.ctx.destroy(linger=sockets.LINGER_MS)

    def stop(self) -> None:
        """Leave the loop (rank 0; from another thread or a signal handler)."""
        self.keep_running = False

    def _release_ranks(self) -> None:
        # Only when the loop ended in order: after an error the other ranks may be inside a
        # collective that rank 0 never reached, and the server stops them from outside.
        try:
            self.sync.stop()
        except Exception as exc:  # a rank is gone already: the server stops the rest
            logger.warning("could not release the other TP ranks: %s", exc)

    def _next_messages(self) -> list[Any] | None:
        """This iteration's messages, the same list on every rank; None: leave the loop.
        Only rank 0 reads the inbox, and only rank 0 decides to stop."""
        if not self.sync.reads_inbox:
            return self.sync.exchange()
        if not self.keep_running:
            return None
        assert self.inbox is not None
        idle = not self.scheduler.has_work and not self.wait_for_idle
        msgs = sockets.recv_all(self.inbox, IDLE_POLL_MS if idle else 0)
        if idle and not msgs and not parent_alive(self.parent_pid):
            logger.warning("parent process is gone; exiting")
            return None
        return self.sync.exchange(msgs)

    def _send(self, msg: Any) -> None:
        if self.outbox is not None:  # rank 0 speaks for every rank
            sockets.send(self.outbox, msg)

    def _loop(self) -> None:
        while (msgs := self._next_messages()) is not None:
            outputs: list[TokenOutput] = []
            for msg in msgs:
                try:
                    self._handle(msg, outputs)
                except Exception:
                    logger.exception("failed to handle %s", type(msg).__name__)
            # Anything that may have moved pages (requests, aborts, steps) re-arms the guard;
            # stats scrapes do not, so an idle server is not checked over and over.
            moved = any(isinstance(m, AddRequests | AbortRequests) for m in msgs)
            self.dirty = self.dirty or moved or self.scheduler.has_work
            if self.scheduler.has_work:
                outputs += self._step()
            if outputs:
                self._send(StepOutputs(outputs))
            if not self.scheduler.has_work:
                # Idle-time work changes no scheduler state, so on each rank it may run on
                # that rank's own clock (the leak guard) or cache (the tokenizer).
                self._answer_idle_requests()
                self._idle_integrity_check()
                if isinstance(self.decoder, StopStringDecoder):
                    self.decoder.preload()

    def _handle(self, msg: Any, outputs: list[TokenOutput]) -> None:
        if isinstance(msg, AddRequests):
            self._add(msg, outputs)
        elif isinstance(msg, AbortRequests):
            for rid in msg.rids:
                phase = _phase(self.live[rid]) if rid in self.live else None
                req = self.state.op_abort(rid)
                if req is not None and phase is not None:
                    self.aborts[phase] += 1
                if req is not None and rid in self.live:
                    outputs.append(self._progress(req))
        elif isinstance(msg, ControlRequest):
            if msg.kind == "ping":  # liveness (server/frontend.py): the loop is turning
                self._send(ControlReply(msg.cid, True))
            elif msg.kind == "stats":
                if self.sync.reads_inbox:  # a read of rank 0's state: no other rank is needed
                    self._send(ControlReply(msg.cid, True, self._stats()))
            elif msg.kind in ("integrity", "flush_cache"):
                self.wait_for_idle.append(msg)
            else:
                self._send(ControlReply(msg.cid, False, {"error": f"unknown {msg.kind!r}"}))
        else:
            logger.error("unexpected message %r", type(msg).__name__)

    # ------------------------------------------------------------ requests
    def _add(self, msg: AddRequests, outputs: list[TokenOutput]) -> None:
        if self._queue_full(len(msg.reqs)):
            self.rejected_queue_full += 1
            message = (
                f"the server is overloaded: {len(self.scheduler.waiting)} requests are already "
                f"waiting (limit {self.max_queued}); retry later"
            )
            outputs += [error_output(r.rid, message, 503) for r in msg.reqs]
            return
        # Validate every request of the HTTP request before queueing any of them.
        try:
            params = [self._params(r.input_ids, r.params) for r in msg.reqs]
            for r, p in zip(msg.reqs, params, strict=True):
                self.scheduler.check_request(r.input_ids, p, r.priority)
                if r.rid in self.live:
                    raise ValueError(f"request id {r.rid} is already in use")
        except (ValueError, TypeError) as exc:
            outputs += [error_output(r.rid, str(exc), 400) for r in msg.reqs]
            return
        for r, p in zip(msg.reqs, params, strict=True):
            self.live[r.rid] = self.scheduler.add_request(
                r.input_ids, p, uid=r.rid, priority=r.priority
            )
            self.reported[r.rid] = 0

    def _queue_full(self, new: int) -> bool:
        """Would ``new`` more sequences leave more than the limit waiting? Sequences that will
        take a free request slot at the next step do not count as waiting. An empty queue
        always accepts, so that a request with many choices is slow, never impossible."""
        waiting = len(self.scheduler.waiting)
        if self.max_queued is None or waiting == 0:
            return False
        return waiting + new - len(self.scheduler.kv.free_rows) > self.max_queued

    def _params(self, input_ids: list[int], fields: dict[str, Any]) -> SamplingParams:
        fields = dict(fields)
        room = self.context_length - len(input_ids)
        if fields.get("max_tokens") is None:
            fields["max_tokens"] = max(1, room)  # "as many as fit"
        elif len(input_ids) < self.context_length and fields["max_tokens"] > room:
            raise ValueError(
                f"this model's maximum context length is {self.context_length} tokens, but "
                f"{len(input_ids) + fields['max_tokens']} were requested ({len(input_ids)} in "
                f"the prompt, max_tokens={fields['max_tokens']} for the completion); "
                "reduce the prompt or max_tokens"
            )
        return SamplingParams(**fields)

    # ------------------------------------------------------------ stepping
    def _step(self) -> list[TokenOutput]:
        try:
            changed = self.state.op_step()
        except Exception as exc:
            if self.sync.tp.size > 1:
                # The other ranks may wait inside a collective this rank never reached (or
                # be past one it failed in): they cannot be brought back in step. Exit; the
                # server notices, fails the pending requests and stops every rank.
                raise
            logger.exception("scheduler step failed; aborting the running requests")
            return self._abort_running(f"internal error while running the batch: {exc!r}")
        return [self._progress(req) for req in changed if req.uid in self.live]

    def _abort_running(self, message: str) -> list[TokenOutput]:
        outputs = []
        for req in list(self.scheduler.running):
            try:
                self.scheduler.abort(req.uid)
            except Exception:
                logger.exception("aborting request %d failed", req.uid)
            if self.live.pop(req.uid, None) is not None:
                self.reported.pop(req.uid, None)
                outputs.append(error_output(req.uid, message, 500))
        # If the failure left KV bookkeeping inconsistent, serving on would corrupt outputs:
        # let the process die (the server notices and exits) rather than answer wrongly.
        # (The check is only defined between batches, i.e. with no batch in flight.)
        if self.scheduler.inflight is None:
            self.scheduler.check_integrity()
        return outputs

    def _progress(self, req: Req) -> TokenOutput:
        out = token_output(req, self.reported[req.uid])
        self.reported[req.uid] = len(req.output_ids)
        if req.finished:
            del self.live[req.uid], self.reported[req.uid]
        return out

    # ------------------------------------------------------------ control
    def _answer_idle_requests(self) -> None:
        for msg in self.wait_for_idle:
            if msg.kind == "flush_cache":
                ok = self.scheduler.flush_cache()  # every rank flushes: caches stay identical
                self._send(ControlReply(msg.cid, ok, self._stats()))
            else:
                self._integrity(msg.cid)
        self.wait_for_idle.clear()

    def _idle_integrity_check(self) -> None:
        """The leak guard: once idle after work, every page must be free or evictable and
        every request row free. A violation is logged and counted; serving goes on."""
        if self.dirty and time.monotonic() - self.last_check >= INTEGRITY_INTERVAL_S:
            self._check_integrity()
            trim_heap()

    def _check_integrity(self) -> str | None:
        self.dirty, self.last_check = False, time.monotonic()
        self.integrity_checks += 1
        try:
            self.scheduler.check_integrity()
            return None
        except Exception as exc:  # AssertionError, or the check itself tripping on bad state
            error = str(exc) or f"integrity check failed ({type(exc).__name__})"
        self.integrity_violations += 1
        logger.error(
            "KV leak detected (integrity violation #%d): %s; running=%d waiting=%d "
            "free_pages=%d evictable_pages=%d total_pages=%d",
            self.integrity_violations, error, len(self.scheduler.running),
            len(self.scheduler.waiting), self.scheduler.kv.allocator.num_free_pages,
            self.scheduler.kv.cache.evictable_pages, self.engine.pool.num_pages,
        )  # fmt: skip
        return error

    def _integrity(self, cid: int) -> None:
        """Every rank checks its own KV state; rank 0 answers for all of them, and fails the
        check too if the ranks no longer hold the same state (every step must agree)."""
        from minisgl.tp.mirror import report_problems

        own = self._check_integrity()
        reports = self.sync.gather({"rank": self.state.rank, "error": own, **self.state.summary()})
        if reports is None:
            return  # not rank 0
        error = own if len(reports) == 1 else "; ".join(report_problems(reports)) or None
        if error is not None and own is None:  # only another rank found it: count it here
            self.integrity_violations += 1
            logger.error("TP integrity violation: %s", error)
        data = self._stats()
        data["ok"], data["error"], data["live_requests"] = error is None, error, len(self.live)
        data["ranks"] = reports
        self._send(ControlReply(cid, error is None, data))

    def _stats(self) -> dict[str, Any]:
        s = self.scheduler
        stats = s.kv.cache.stats
        return {
            "running": len(s.running),
            "waiting": len(s.waiting),
            "free_pages": s.kv.allocator.num_free_pages,
            "evictable_pages": s.kv.cache.evictable_pages,
            "total_pages": self.engine.pool.num_pages,
            "page_size": s.page_size,
            "prefix_hit_rate": stats.hit_rate,
            "prefix_looked_up_tokens": stats.looked_up_tokens,
            "prefix_matched_tokens": stats.matched_tokens,
            "retractions": s.num_retractions,
            "priority_preemptions": s.num_priority_preemptions,
            "spec_verify_steps": s.stats.get("spec_rows", 0),
            "spec_draft_tokens": s.stats.get("spec_drafted", 0),
            "spec_accepted_tokens": s.stats.get("spec_accepted", 0),
            "integrity_checks": self.integrity_checks,
            "integrity_violations": self.integrity_violations,
            "rejected_queue_full": self.rejected_queue_full,
            **{f"aborts_{phase}": n for phase, n in self.aborts.items()},
        }


@functools.cache
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """Give the C heap's free memory back to the OS, once idle after work. Bursts of large
    temporaries (long prefills, prompt-logprob logits on CPU) would otherwise keep the
    process at its high-water mark for good: glibc returns little of it by itself."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _phase(req: Req) -> str:
    """Where an aborted request was: queued (or retracted), still in prefill, or decoding."""
    from minisgl.scheduler.request import ReqState

    if req.state is ReqState.WAITING:
        return "waiting"
    return "prefill" if req.num_generated == 0 else "decode"


def server_decoder(engine: Any, config: EngineConfig, copy_dir: str) -> Callable[[list[int]], str]:
    """Ranks on node 0 read the tokenizer copy the worker saved; ranks on other nodes have no
    such copy (nor worker) and load the tokenizer themselves, if a request needs it."""
    if Topology.of(config).node_of(engine.tp.rank) == 0:
        return StopStringDecoder(copy_dir)
    return LazyDecoder(engine.resolved, config.tokenizer)


def _speculative_algorithm(config: EngineConfig) -> str | None:
    # Interim: the server decides from this whether responses carry speculation figures.
    for group in config.extensions:
        algorithm = getattr(group, "speculative_algorithm", None)
        if algorithm is not None:
            return str(algorithm)
    return None
