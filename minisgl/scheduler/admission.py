"""Admission and chunked prefill: which prompt chunks a step computes, and which waiting
requests it admits.

A step's token budget goes first to the running requests with prompt tokens still to
prefill (chunks, in the policy's order), then to waiting requests, in the policy's admission
order, each of which needs a page-table row and pages for its first chunk. Admission is
optimistic: it sets aside pages for only a share (``ratio``) of each request's remaining
``max_tokens``, a share that decays step by step towards a floor and goes back up when the
guess proves too bold (a request had to be retracted: preemption.py).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable

from minisgl.engine.engine import Engine
from minisgl.scheduler.kv_manager import KVManager
from minisgl.scheduler.policy import Policy
from minisgl.scheduler.request import Req, ReqState, Row

IN_BATCH_PREFIX_MIN = 32  # defer a request that shares this many uncached tokens with one admitted


class Admission:
    def __init__(
        self,
        kv: KVManager,
        policy: Policy,
        waiting: deque[Req],
        running: list[Req],
        engine: Engine,
        on_admit: Callable[[Req], None],
    ) -> None:
        self.kv, self.policy, self.waiting, self.running = kv, policy, waiting, running
        self.config = config = engine.config
        self.context_length = engine.context_length
        self.chunk_size = engine.chunked_prefill_size  # the step's token budget
        self.on_admit = on_admit  # e.g. restore a recomputed request's penalty state
        self.ratio = config.init_new_token_ratio
        self.ratio_decay = (config.init_new_token_ratio - config.min_new_token_ratio) / 600
        self.admit_counter = itertools.count()
        # By priority: the last admission stopped at a request for want of a row or pages,
        # so the next step may preempt lower priorities for it (preemption.py).
        self.blocked = False

    # ------------------------------------------------------------ the growth estimate
    def growth(self, r: Req) -> int:
        """Tokens a request may still add: its max_tokens, but never past the context."""
        return min(
            r.params.max_new_tokens - r.num_generated, self.context_length - r.num_tokens, 4096
        )

    def growth_pages(self, r: Req) -> int:
        """Pages admission sets aside for a request's expected growth."""
        return int(self.growth(r) * self.ratio) // self.kv.page_size

    def reserve_pages(self) -> int:
        """Pages kept back for the growth of running requests (not reserved in full)."""
        tokens = sum(self.growth(r) for r in self.running if not r.finished)
        return int(tokens * self.ratio) // self.kv.page_size

    def decay(self) -> None:
        """A step was launched: guess a little less room for future tokens."""
        self.ratio = max(self.config.min_new_token_ratio, self.ratio - self.ratio_decay)

    def reset(self) -> None:
        """Pages ran out: guess conservatively again."""
        self.ratio = self.config.init_new_token_ratio

    # ------------------------------------------------------------ the step's prefill rows
    def schedule(self, partial: list[Req], budget: int) -> list[Row]:
        """Prefill rows within ``budget`` tokens: chunks of running requests, then admissions."""
        rows: list[Row] = []
        reserve = self.reserve_pages()
        for r in sorted(partial, key=self.policy.rank_key):
            if budget <= 0:
                return rows
            n = min(r.pending, budget)
            if self.kv.pages_for(r, n) > self.kv.available_pages - reserve:
                continue
            if not self.kv.allocate(r, n):
                continue
            rows.append(Row(r, n, n == r.pending))
            budget -= n
        return rows + self._admit(budget, reserve)

    def _admit(self, budget: int, reserve: int) -> list[Row]:
        rows: list[Row] = []
        admitted: dict[tuple[int, ...], list[Req]] = {}
        for req in self.policy.admission_order(self.waiting, self._cached_len):
            if budget <= 0:
                break
            if req.inflight:
                continue  # retracted with a token in flight: wait until its value is known
            if not self.kv.admit(req):  # no free row
                self.blocked = self.policy.by_priority
                break
            if self.kv.reuse and _shares_uncached_prefix(req, admitted):
                self.kv.release(req)
                continue
            if self.kv.left_in_tier and self.running:
                # Part of its prefix is still in HiCache's host tier, short of device pages:
                # wait for running requests to free some rather than recompute it.
                self.kv.release(req)
                self.blocked = self.policy.by_priority
                break
            n = min(req.pending, budget)
            own = self.growth_pages(req)
            if not self._fits(req, n, own, reserve):
                self.kv.release(req)
                self.blocked = self.policy.by_priority
                break  # in policy order: do not let later requests jump the queue
            self._start(req)
            admitted.setdefault(_lead(req), []).append(req)
            rows.append(Row(req, n, n == req.pending))
            budget -= n
            reserve += own
        return rows

    def _fits(self, req: Req, n: int, own: int, reserve: int) -> bool:
        """Allocate the first chunk of an admitted request if its pages and expected growth
        fit beside the reserve. The growth estimate only holds back admission beside running
        requests: alone, a request whose chunk fits must start (else the loop would spin). A
        chunk that cannot fit is not tried: allocate would evict the cache first."""
        chunk_pages = self.kv.pages_for(req, n)
        short = chunk_pages + own > self.kv.available_pages - reserve and bool(self.running)
        if short or chunk_pages > self.kv.available_pages:
            return False
        return self.kv.allocate(req, n)

    def _start(self, req: Req) -> None:
        self.waiting.remove(req)
        req.state = ReqState.RUNNING
        req.admit_order = next(self.admit_counter)
        if not req.admitted_once:
            req.cached_tokens, req.admitted_once = req.kv_len, True
            req.queue_time = time.monotonic() - req.arrived
        self.on_admit(req)
        self.running.append(req)

    def _cached_len(self, req: Req) -> int:
        tokens = req.token_slice(0, req.num_tokens - 1)
        return self.kv.cache.match_prefix(tokens, count=False).length

    def admissible(self, req: Req) -> bool:
        """Whether admission would now take ``req`` (an estimate of `schedule`'s test: a free
        row, and pages for its first chunk plus its expected growth beside the growth
        reserved for running requests)."""
        if not self.kv.free_rows:
            return False
        cached = self.kv.cached_prefix(req, count=False).length
        n = min(req.num_tokens - cached, self.chunk_size)
        need = -(-n // self.kv.page_size) + self.growth_pages(req)
        return need <= self.kv.available_pages - (self.reserve_pages() if self.running else 0)


def _lead(req: Req) -> tuple[int, ...]:
    return tuple(req.prompt_ids[:IN_BATCH_PREFIX_MIN])


def _shares_uncached_prefix(req: Req, admitted: dict[tuple[int, ...], list[Req]]) -> bool:
    """True if an already-admitted request of this step computes the same prefix: wait for it
    to land in the cache instead of computing it twice. ``admitted`` buckets this step's
    requests by their leading tokens, so the check is cheap for unrelated prompts."""
    for other in admitted.get(_lead(req), ()):
        if _shares_prefix(req.prompt_ids, other.prompt_ids, req.kv_len + IN_BATCH_PREFIX_MIN):
            return True
    return False


def _shares_prefix(a: list[int], b: list[int], n: int) -> bool:
    """Whether a and b agree on their first n tokens. List comparisons run in C; the window
    past the cached part goes first, as it tells apart requests that share only a cached
    system prompt (the usual case) without comparing the thousands of tokens before it."""
    if len(a) < n or len(b) < n:
        return False
    lo = n - IN_BATCH_PREFIX_MIN
    return a[lo:n] == b[lo:n] and a[:lo] == b[:lo]
