"""The scheduler process: a loop around `Scheduler` that talks ZMQ.

Each iteration: take every queued message (blocking only when there is nothing to run), apply
them, run one step, and send one `StepOutputs` with the new tokens of every request that
progressed. Per-request failures become error outputs for that request; a failing step aborts
the requests that were running and the loop goes on.

Tensor parallelism (later): each rank runs this loop in its own process. Rank 0 owns the inbox
and must forward what it received to the other ranks before applying it, so that every rank
applies the same messages in the same order and builds identical batches; only rank 0 sends
outputs. `_sync_across_ranks` is that hook.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from minisgl.config import EngineConfig
from minisgl.ipc import sockets
from minisgl.ipc.child import parent_alive, run_child, setup_child, startup_report
from minisgl.ipc.messages import (
    AbortRequests,
    AddRequests,
    ControlReply,
    ControlRequest,
    StepOutputs,
    TokenLogprob,
    TokenOutput,
    TopLogprob,
)
from minisgl.sampling_params import SamplingParams

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
        from minisgl.engine.engine import Engine

        engine = Engine(args.config)
        loop = SchedulerLoop(engine, args)
        ready(
            {
                "context_length": engine.context_length,
                "vocab_size": engine.model_config.vocab_size,
                "num_pages": engine.pool.num_pages,
                "page_size": args.config.page_size,
                "model_path": str(engine.resolved.path),
                "device": str(engine.device),
            }
        )
        loop.run()


class StopStringDecoder:
    """``decode`` for the scheduler's stop-string check, loaded lazily from the tokenizer copy
    the worker saves. Requests reach the scheduler only through the worker, which saves the
    copy before it handles any message, so the copy exists by the time it is needed."""

    def __init__(self, copy_dir: str) -> None:
        self.copy_dir = Path(copy_dir)
        self.tokenizer: Any = None

    def preload(self) -> None:
        if self.tokenizer is None and self.copy_dir.is_dir():
            self._load()

    def _load(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.copy_dir))

    def __call__(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            self._load()
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))


class SchedulerLoop:
    def __init__(self, engine: Any, args: SchedulerArgs) -> None:
        from minisgl.scheduler.scheduler import Scheduler

        self.engine = engine
        self.parent_pid = args.parent_pid
        self.tp_rank = args.tp_rank
        self.decoder = StopStringDecoder(args.tokenizer_copy_dir)
        self.scheduler = Scheduler(engine, decode=self.decoder)
        self.context_length = self.scheduler.context_length
        self.ctx = zmq.Context()
        self.inbox = sockets.bind_pull(self.ctx, args.addresses.scheduler)
        self.outbox = sockets.connect_push(self.ctx, args.addresses.worker)
        self.live: dict[int, Req] = {}
        self.reported: dict[int, int] = {}  # output tokens already sent, per request
        self.wait_for_idle: list[ControlRequest] = []
        self.keep_running = True  # cleared by stop() (in-process use, e.g. tests)
        self.max_queued = args.max_queued_requests
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
        finally:
            # Close the sockets explicitly: a context with open sockets would block exit.
            self.ctx.destroy(linger=sockets.LINGER_MS)

    def stop(self) -> None:
        self.keep_running = False

    def _loop(self) -> None:
        while self.keep_running:
            busy = self.scheduler.has_work
            msgs = sockets.recv_all(self.inbox, 0 if busy or self.wait_for_idle else IDLE_POLL_MS)
            msgs = self._sync_across_ranks(msgs)
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
                sockets.send(self.outbox, StepOutputs(outputs))
            if not self.scheduler.has_work:
                self._answer_idle_requests()
                self._idle_integrity_check()
                self.decoder.preload()
                if not msgs and not parent_alive(self.parent_pid):
                    logger.warning("parent process is gone; exiting")
                    return

    def _sync_across_ranks(self, msgs: list[Any]) -> list[Any]:
        """TP hook: rank 0 would broadcast ``msgs`` here and other ranks would return what
        rank 0 sent instead of reading an inbox. With one rank there is nothing to do."""
        return msgs

    def _handle(self, msg: Any, outputs: list[TokenOutput]) -> None:
        if isinstance(msg, AddRequests):
            self._add(msg, outputs)
        elif isinstance(msg, AbortRequests):
            for rid in msg.rids:
                phase = _phase(self.live[rid]) if rid in self.live else None
                req = self.scheduler.abort(rid)
                if req is not None and phase is not None:
                    self.aborts[phase] += 1
                if req is not None and rid in self.live:
                    outputs.append(self._progress(req))
        elif isinstance(msg, ControlRequest):
            if msg.kind == "stats":
                sockets.send(self.outbox, ControlReply(msg.cid, True, self._stats()))
            elif msg.kind in ("integrity", "flush_cache"):
                self.wait_for_idle.append(msg)
            else:
                sockets.send(
                    self.outbox, ControlReply(msg.cid, False, {"error": f"unknown {msg.kind!r}"})
                )
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
            outputs += [_error(r.rid, message, 503) for r in msg.reqs]
            return
        # Validate every request of the HTTP request before queueing any of them.
        try:
            params = [self._params(r.input_ids, r.params) for r in msg.reqs]
            for r in msg.reqs:
                self.scheduler.check_prompt(r.input_ids)
                if r.rid in self.live:
                    raise ValueError(f"request id {r.rid} is already in use")
        except (ValueError, TypeError) as exc:
            outputs += [_error(r.rid, str(exc), 400) for r in msg.reqs]
            return
        for r, p in zip(msg.reqs, params, strict=True):
            self.live[r.rid] = self.scheduler.add_request(r.input_ids, p, uid=r.rid)
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
            changed = self.scheduler.step()
        except Exception as exc:
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
                outputs.append(_error(req.uid, message, 500))
        # If the failure left KV bookkeeping inconsistent, serving on would corrupt outputs:
        # let the process die (the server notices and exits) rather than answer wrongly.
        # (The check is only defined between batches, i.e. with no batch in flight.)
        if self.scheduler.inflight is None:
            self.scheduler.check_integrity()
        return outputs

    def _progress(self, req: Req) -> TokenOutput:
        start = self.reported[req.uid]
        out = TokenOutput(
            rid=req.uid,
            new_ids=req.output_ids[start:],
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            finish_reason=req.finish_reason if req.finished else None,
            matched_stop=req.matched_stop if req.finished else None,
        )
        if start == 0 and req.params.prompt_logprobs is not None:
            out.prompt_logprobs = [
                TokenLogprob(
                    token_id=req.prompt_ids[i + 1],
                    logprob=float(lp),
                    top=[TopLogprob(int(t), float(v)) for t, v in req.prompt_top_logprobs[i]]
                    if i < len(req.prompt_top_logprobs)
                    else [],
                )
                for i, lp in enumerate(req.prompt_logprobs)
            ]
        if req.params.wants_logprobs:
            lps = req.output_logprobs[start:] if req.params.logprobs else []
            tops = req.output_top_logprobs[start:]
            out.logprobs = [
                TokenLogprob(
                    token_id=tok,
                    logprob=lps[i] if i < len(lps) else 0.0,
                    top=[TopLogprob(int(t), float(lp)) for t, lp in tops[i]]
                    if i < len(tops)
                    else [],
                )
                for i, tok in enumerate(out.new_ids)
            ]
        self.reported[req.uid] = len(req.output_ids)
        if req.finished:
            del self.live[req.uid], self.reported[req.uid]
        return out

    # ------------------------------------------------------------ control
    def _answer_idle_requests(self) -> None:
        for msg in self.wait_for_idle:
            if msg.kind == "flush_cache":
                ok = self.scheduler.flush_cache()
                reply = ControlReply(msg.cid, ok, self._stats())
            else:
                reply = self._integrity(msg.cid)
            sockets.send(self.outbox, reply)
        self.wait_for_idle.clear()

    def _idle_integrity_check(self) -> None:
        """The leak guard: once idle after work, every page must be free or evictable and
        every request row free. A violation is logged and counted; serving goes on."""
        if self.dirty and time.monotonic() - self.last_check >= INTEGRITY_INTERVAL_S:
            self._check_integrity()

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

    def _integrity(self, cid: int) -> ControlReply:
        error = self._check_integrity()
        data = self._stats()
        data["ok"], data["error"], data["live_requests"] = error is None, error, len(self.live)
        return ControlReply(cid, error is None, data)

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
            "integrity_checks": self.integrity_checks,
            "integrity_violations": self.integrity_violations,
            "rejected_queue_full": self.rejected_queue_full,
            **{f"aborts_{phase}": n for phase, n in self.aborts.items()},
        }


def _phase(req: Req) -> str:
    """Where an aborted request was: queued (or retracted), still in prefill, or decoding."""
    from minisgl.scheduler.request import ReqState

    if req.state is ReqState.WAITING:
        return "waiting"
    return "prefill" if req.num_generated == 0 else "decode"


def _error(rid: int, message: str, status: int) -> TokenOutput:
    return TokenOutput(
        rid=rid, new_ids=[], finish_reason="abort", error=message, error_status=status
    )
