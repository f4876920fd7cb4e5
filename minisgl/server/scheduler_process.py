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

import dataclasses
import logging
import signal
from dataclasses import dataclass
from functools import partial
from multiprocessing.queues import Queue
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from minisgl.config import EngineConfig
from minisgl.distributed.topology import Topology
from minisgl.ipc import child, sockets
from minisgl.ipc.messages import (
    AbortRequests,
    AddRequests,
    ControlRequest,
    StepOutputs,
    TokenOutput,
)
from minisgl.scheduler.outputs import error_output, token_output
from minisgl.scheduler.stop import TokenizerDecoder
from minisgl.server.scheduler_control import LoopControl, abort_phase, fit_context
from minisgl.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine
    from minisgl.scheduler.request import Req

# torch and the engine are imported inside the child only: the server process imports this
# module just to name run_scheduler as the spawn target, and should stay light.

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 500  # an idle scheduler wakes this often to check on its parent


@dataclass(frozen=True)
class SchedulerArgs:
    config: EngineConfig
    addresses: sockets.IpcAddresses
    tokenizer_copy_dir: str  # written by the tokenizer worker (see tokenizer/worker.py)
    parent_pid: int
    tp_rank: int = 0
    log_level: str = "info"
    max_queued_requests: int | None = None  # None: queue without limit


def run_scheduler(args: SchedulerArgs, report_queue: Queue[child.ChildReport]) -> None:
    """Entry point of the scheduler process (spawned)."""
    child.setup_child(args.log_level)
    child.run_child(lambda: _serve(args, report_queue))


def _serve(args: SchedulerArgs, report_queue: Queue[child.ChildReport]) -> None:
    with child.startup_report(f"scheduler-tp{args.tp_rank}", report_queue) as ready:
        from minisgl.distributed import TPInfo
        from minisgl.engine.engine import Engine

        tp = TPInfo(args.tp_rank, args.config.tp_size)
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
                "max_running_requests": engine.max_running_requests,
                "chunked_prefill_size": engine.chunked_prefill_size,
                "model_path": str(engine.resolved.path),
                "model_type": engine.model_config.model_type,
                "architecture": engine.model_config.architecture,
                "device": str(engine.device),
            }
        )
        child.freeze_startup_heap()
        loop.run()
    if tp.size > 1:
        # Leave gloo/NCCL before the interpreter exits: tearing down a live group at exit
        # can abort the process ("terminate called without an active exception").
        from minisgl.tp import leave_tp_group

        leave_tp_group()


class SchedulerLoop:
    def __init__(self, engine: Engine, args: SchedulerArgs) -> None:
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
        max_queued = self.sync.share(args.max_queued_requests)
        # Ranks on node 0 read the tokenizer copy the worker saved (the worker saves it before
        # it passes on any request), and load it ahead when idle; ranks on other nodes have no
        # such copy (nor worker) and load the tokenizer themselves, if a request needs it.
        on_node0 = Topology.of(args.config).node_of(engine.tp.rank) == 0
        # Loaded while idle on GPU hosts, so that the first stop string costs no load; a CPU
        # engine loads it when a request needs it (transformers and the vocabulary are a
        # large share of its small resident set: benchmark/RESULTS.md).
        warm = on_node0 and engine.device.type == "cuda"
        self.tokenizer_copy = Path(args.tokenizer_copy_dir) if warm else None
        source = args.tokenizer_copy_dir if on_node0 else args.config.tokenizer
        self.decoder = TokenizerDecoder(load=partial(load_tokenizer, engine.resolved, source))
        self.scheduler = Scheduler(engine, decode=self.decoder)
        # Steps and aborts go through it: it folds what each step produced into a digest,
        # which /debug/integrity compares across the ranks.
        self.state = RankState(self.scheduler, engine.tp.rank)
        self.context_length = self.scheduler.context_length
        self.ctx = zmq.Context()
        self.inbox: sockets.Socket | None = None
        self.outbox: sockets.Socket | None = None
        if self.sync.reads_inbox:
            self.inbox = sockets.bind_pull(self.ctx, args.addresses.scheduler)
            self.outbox = sockets.connect_push(self.ctx, args.addresses.worker)
        self.live: dict[int, Req] = {}
        self.reported: dict[int, int] = {}  # output tokens already sent, per request
        self.keep_running = True  # cleared by stop() (in-process use, e.g. tests)
        self.control = LoopControl(
            self.scheduler, self.state, self.sync, self._send, lambda: len(self.live)
        )
        self.control.max_queued = max_queued

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

    def _next_messages(self) -> list[object] | None:
        """This iteration's messages, the same list on every rank; None: leave the loop.
        Only rank 0 reads the inbox, and only rank 0 decides to stop."""
        if not self.sync.reads_inbox:
            return self.sync.exchange()
        if not self.keep_running:
            return None
        assert self.inbox is not None
        idle = not self.scheduler.has_work and not self.control.wait_for_idle
        msgs = sockets.recv_all(self.inbox, IDLE_POLL_MS if idle else 0)
        if idle and not msgs and not child.parent_alive(self.parent_pid):
            logger.warning("parent process is gone; exiting")
            return None
        return self.sync.exchange(msgs)

    def _send(self, msg: object) -> None:
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
            self.control.dirty = self.control.dirty or moved or self.scheduler.has_work
            if self.scheduler.has_work:
                outputs += self._step()
            if outputs:
                self._send(StepOutputs(outputs))
            if not self.scheduler.has_work:
                # Idle-time work changes no scheduler state (each rank may do it on its own
                # clock): control replies, the leak guard, warming the tokenizer.
                self.control.on_idle()
                copy = self.tokenizer_copy
                if copy is not None and not self.decoder.loaded and copy.is_dir():
                    _ = self.decoder.tokenizer  # loaded now, not when a request needs it

    def _handle(self, msg: object, outputs: list[TokenOutput]) -> None:
        if isinstance(msg, AddRequests):
            self._add(msg, outputs)
        elif isinstance(msg, AbortRequests):
            for rid in msg.rids:
                self._abort(rid, outputs)
        elif isinstance(msg, ControlRequest):
            self.control.handle(msg)
        else:
            logger.error("unexpected message %r", type(msg).__name__)

    def _abort(self, rid: int, outputs: list[TokenOutput]) -> None:
        live = self.live.get(rid)
        phase = abort_phase(live) if live is not None else None  # before the abort moves it
        req = self.state.op_abort(rid)
        if req is not None and phase is not None:
            self.control.aborts[phase] += 1
        if req is not None and rid in self.live:
            outputs.append(self._progress(req))

    # ------------------------------------------------------------ requests
    def _add(self, msg: AddRequests, outputs: list[TokenOutput]) -> None:
        refusal = self.control.overloaded(len(msg.reqs))
        if refusal is not None:
            outputs += [error_output(r.rid, refusal, 503) for r in msg.reqs]
            return
        # Validate every request of the HTTP request before queueing any of them.
        try:
            params = [
                fit_context(r.params, len(r.input_ids), self.context_length) for r in msg.reqs
            ]
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
