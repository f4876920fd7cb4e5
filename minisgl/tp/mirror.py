"""Offline TP: every scheduler call that changes state runs on every rank, in one order.

Rank 0 wraps its `Scheduler` in a `MirroredScheduler`. Each mutating call (add, abort, step,
drain, flush) is first broadcast as ``(op, args)`` on the control channel, then applied by a
`RankState` on rank 0 and, from the same bytes, on every follower (`follow`). The scheduler
is deterministic (decode rows sorted by uid, counter-based sampling with the per-request
seed rank 0 resolved and sent), so identical calls give identical batches, and the all-gathered
logits give identical tokens on every rank.

Each rank folds what every step produced into a digest; `reports` collects the digests with
each rank's integrity check, so a rank that drifted is caught, not just a rank that hung.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

from minisgl.distributed.channel import EventChannel
from minisgl.sampling_params import SamplingParams
from minisgl.scheduler.request import Req
from minisgl.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

# RankState.summary: what every rank must agree on.
SUMMARY_KEYS = ("digest", "steps", "running", "waiting", "free_pages", "evictable_pages")


AddArgs = tuple[Sequence[int], SamplingParams, int]  # prompt ids, params, priority


@dataclass(frozen=True)
class AddItem:
    uid: int
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0


class RankState:
    """Applies one rank's share of the call stream to its scheduler."""

    def __init__(self, scheduler: Scheduler, rank: int) -> None:
        self.scheduler = scheduler
        self.rank = rank
        self.digest = hashlib.blake2b(digest_size=16)
        self.steps = 0

    def apply(self, op: str, args: tuple[object, ...]) -> object:
        return getattr(self, f"op_{op}")(*args)

    def op_add(self, items: list[AddItem]) -> list[Req]:
        # Sorted by uid: the waiting queue's order is part of the state every rank must share,
        # and must not depend on how rank 0 happened to collect the requests.
        reqs = [
            self.scheduler.add_request(it.prompt_ids, it.params, uid=it.uid, priority=it.priority)
            for it in sorted(items, key=lambda it: it.uid)
        ]
        self._fold([(r.uid, "add", r.seed) for r in reqs])
        return reqs

    def op_abort(self, uid: int) -> Req | None:
        req = self.scheduler.abort(uid)
        self._fold([(uid, "abort", req is not None)])
        return req

    def op_step(self) -> list[Req]:
        return self._progress(self.scheduler.step())

    def op_drain(self) -> list[Req]:
        return self._progress(self.scheduler.drain())

    def op_flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def op_report(self) -> dict[str, object]:
        s = self.scheduler
        try:
            s.check_integrity()
            error = None
        except AssertionError as exc:
            error = str(exc) or "integrity check failed"
        params = list(s.engine.model.named_parameters())
        return {
            "rank": self.rank,
            "error": error,
            **self.summary(),
            "num_pages": s.kv.allocator.num_pages,
            "param_shapes": {n: tuple(p.shape) for n, p in params},
            # Bytes each parameter's storage holds: equal to its own size when the rank keeps
            # only its shard (a narrowed view of a full checkpoint tensor would be larger).
            "param_storage_bytes": {n: p.untyped_storage().nbytes() for n, p in params},
        }

    def summary(self) -> dict[str, object]:
        """What every rank must agree on: what the steps produced, and the KV occupancy."""
        s = self.scheduler
        return {
            "digest": self.digest.hexdigest(),
            "steps": self.steps,
            "running": len(s.running),
            "waiting": len(s.waiting),
            "free_pages": s.kv.allocator.num_free_pages,
            "evictable_pages": s.kv.cache.evictable_pages,
        }

    def _progress(self, changed: list[Req]) -> list[Req]:
        self.steps += 1
        self._fold(
            [(r.uid, len(r.output_ids), r.output_ids[-1:], r.finish_reason) for r in changed]
        )
        return changed

    def _fold(self, facts: list[tuple[object, ...]]) -> None:
        if facts:
            self.digest.update(repr(facts).encode())


class MirroredScheduler:
    """Rank 0's scheduler handle: the `Scheduler` interface, mirrored to every rank.

    Reads (``running``, ``kv``, ``has_work``, ``check_request`` ...) go to rank 0's own
    scheduler. Mutate it only through these methods: a direct change on rank 0 (say, of
    ``stop_checker``) would make the ranks diverge.
    """

    def __init__(self, scheduler: Scheduler, channel: EventChannel) -> None:
        self._local = scheduler
        self._channel = channel
        self._state = RankState(scheduler, channel.tp.rank)
        self._stopped = False
        self.broken: str | None = None  # why the ranks may be out of step

    def __getattr__(self, name: str) -> Any:
        return getattr(self._local, name)

    @contextlib.contextmanager
    def _mirrored(self, op: str, *args: object) -> Iterator[RankState]:
        """Send the call to the followers; the block applies it to rank 0's state."""
        if self._stopped:
            raise RuntimeError("the TP ranks have been shut down (LLM.close)")
        if self.broken is not None:
            raise RuntimeError(f"the TP ranks are out of step after {self.broken}; recreate")
        try:
            self._channel.broadcast((op, args))
            yield self._state
        except BaseException as exc:
            # An error (or Ctrl-C) part-way through a call may have left the followers inside
            # a collective that rank 0 never reached: nothing after it can be trusted.
            self.broken = f"{op} failed ({type(exc).__name__})"
            raise

    def add_requests(
        self, items: Sequence[tuple[Sequence[int], SamplingParams] | AddArgs]
    ) -> list[Req]:
        """Queue several (prompt, params[, priority]) with one message; the Reqs come back in
        item order."""
        full = [(*item, 0) if len(item) == 2 else item for item in items]
        for ids, params, priority in full:  # validate on rank 0: followers never see a bad item
            self._local.check_request(ids, params, priority)
        adds = [self._item(next(self._local.uids), ids, p, prio) for ids, p, prio in full]
        with self._mirrored("add", adds) as state:
            return state.op_add(adds)

    def _item(
        self, uid: int, ids: Sequence[int], params: SamplingParams, priority: int = 0
    ) -> AddItem:
        # Rank 0 draws the seed (from the config seed, in the order one rank would) and sends
        # it, so no rank depends on its own random state to sample what the others sample.
        if params.seed is None:
            params = dataclasses.replace(params, seed=self._local.rng.getrandbits(62))
        return AddItem(uid, list(ids), params, priority)

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        uid: int | None = None,
        priority: int = 0,
    ) -> Req:
        if uid is None:
            return self.add_requests([(prompt_ids, params, priority)])[0]
        self._local.check_request(prompt_ids, params, priority)
        adds = [self._item(uid, prompt_ids, params, priority)]
        with self._mirrored("add", adds) as state:
            return state.op_add(adds)[0]

    def abort(self, uid: int) -> Req | None:
        with self._mirrored("abort", uid) as state:
            return state.op_abort(uid)

    def step(self) -> list[Req]:
        with self._mirrored("step") as state:
            return state.op_step()

    def drain(self) -> list[Req]:
        with self._mirrored("drain") as state:
            return state.op_drain()

    def flush_cache(self) -> bool:
        with self._mirrored("flush_cache") as state:
            return state.op_flush_cache()

    def reports(self) -> list[dict[str, object]]:
        """Every rank's integrity check, step digest and shard sizes, in rank order."""
        with self._mirrored("report") as state:
            return self._channel.gather(state.op_report()) or []

    def check_integrity(self) -> None:
        """Each rank's own KV check, plus: every rank applied and produced the same."""
        problems = report_problems(self.reports())
        assert not problems, "; ".join(problems)

    def stop(self) -> bool:
        """Tell the followers to leave their loop; False if they cannot be told (already
        stopped, out of step, or gone) and must be stopped from outside."""
        if self._stopped:
            return False
        self._stopped = True
        if self.broken is not None:
            return False
        try:
            self._channel.broadcast(("stop", ()))
        except Exception:  # a rank died: the others fail their next collective and exit
            return False
        return True


def report_problems(reports: list[dict[str, object]]) -> list[str]:
    """What is wrong across the ranks' reports (``{"rank", "error", **summary()}``, in rank
    order): each rank's own integrity error, and any disagreement between the ranks."""
    problems = [f"rank {r['rank']}: {r['error']}" for r in reports if r["error"] is not None]
    first = reports[0]
    for r in reports[1:]:
        differ = [k for k in SUMMARY_KEYS if r[k] != first[k]]
        if differ:
            problems.append(
                f"ranks diverged: rank {r['rank']} has "
                + ", ".join(f"{k}={r[k]!r} (rank 0: {first[k]!r})" for k in differ)
            )
    return problems


def follow(state: RankState, channel: EventChannel) -> None:
    """A follower's loop: apply what rank 0 sends until it says stop."""
    while True:
        op, args = cast("tuple[str, tuple[object, ...]]", channel.broadcast())
        if op == "stop":
            return
        try:
            result = state.apply(op, args)
        except Exception:
            # Rank 0 ran the same call on the same state and saw the same error; staying in
            # the loop keeps this rank in step with it.
            logger.exception("rank %d: %s failed", state.rank, op)
            result = None
        if op == "report":  # per-rank results, collected on rank 0
            channel.gather(result)
