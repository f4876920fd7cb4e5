"""Per-request KV bookkeeping: page-table rows, page allocation, prefix-cache hand-over.

Every page is in exactly one place: the allocator's free list, the prefix cache (a tree
node), or a request's private range ``[tree_len, alloc_len)`` of its page-table row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

from minisgl.engine.step import TableUpdate
from minisgl.kernels.staging import DeviceStager
from minisgl.kvcache.allocator import PageAllocator
from minisgl.kvcache.naive_cache import NaiveCache
from minisgl.kvcache.prefix_cache import MatchResult, PrefixCache
from minisgl.kvcache.radix_cache import RadixCache, RadixNode
from minisgl.kvcache.tier import HOST_CACHED_TOKENS, CacheTier
from minisgl.kvcache.tiered_cache import TieredRadixCache
from minisgl.scheduler.request import Req


class KVManager:
    def __init__(
        self,
        page_table: torch.Tensor,
        num_pages: int,
        page_size: int,
        max_requests: int,
        cache_kind: str,
        stager: DeviceStager | None = None,
        tier: CacheTier | None = None,
    ) -> None:
        self.page_size = page_size
        self.stager = stager or DeviceStager(page_table.device)
        # How many leading tokens of a request may enter the prefix cache: those whose K/V is
        # written (a speculator with a K/V pool of its own may allow fewer, see plugins.py).
        self.cacheable: Callable[[Req], int] = _kv_len
        self.device_table = page_table
        # The host mirror is what the scheduler reads; on CPU it is the same tensor.
        self.host_table = (
            page_table
            if page_table.device.type == "cpu"
            else torch.zeros_like(page_table, device="cpu")
        )
        self.allocator = PageAllocator(num_pages, page_size)
        self.tier = tier if cache_kind == "radix" else None  # HiCache's host tier (tier.py)
        self.cache: PrefixCache = NaiveCache(self.allocator)
        if self.tier is not None:
            self.cache = TieredRadixCache(self.allocator, self.tier)
        elif cache_kind == "radix":
            self.cache = RadixCache(self.allocator)
        self.reuse = cache_kind == "radix"
        self.free_rows = list(range(max_requests - 1, -1, -1))
        self.max_requests = max_requests
        # Tokens of the last admitted prefix left in the tier for want of device pages.
        self.left_in_tier = 0
        # (row index, column index) tensors of host entries to mirror to the device
        self._dirty: list[tuple[torch.Tensor, torch.Tensor]] = []

    # ------------------------------------------------------------ capacity
    @property
    def available_pages(self) -> int:
        return self.allocator.num_free_pages + self.cache.evictable_pages

    def pages_for(self, req: Req, new_tokens: int) -> int:
        need = req.kv_len + new_tokens - req.alloc_len
        return max(0, -(-need // self.page_size))

    def _alloc(self, n: int) -> torch.Tensor | None:
        if n > self.allocator.num_free_pages:
            self.cache.evict(n - self.allocator.num_free_pages)
        return self.allocator.alloc(n)

    # ------------------------------------------------------------ lifecycle
    def admit(self, req: Req) -> bool:
        """Give the request a row and lock its cached prefix. False if no row is free."""
        if not self.free_rows:
            return False
        req.row = self.free_rows.pop()
        match = self.cached_prefix(req)
        host = req.counters.get(HOST_CACHED_TOKENS, 0)
        if match.host_length:  # part of the prefix is in the tier only: copy it back
            device = match.length
            match = self.cache.load(match)
            host = max(host, match.length - device)
        self.left_in_tier = match.host_length
        if host and not req.admitted_once:  # a share of cached_tokens (admission.py)
            req.counters[HOST_CACHED_TOKENS] = min(host, match.length)
        self.cache.lock(match.node)
        req.tree_node, req.tree_len = match.node, match.length
        req.kv_len = req.alloc_len = match.length
        if match.length:
            self.host_table[req.row, : match.length] = match.slots
            self._dirty.append(ranges([req.row], [0], [match.length]))
        return True

    def cached_prefix(self, req: Req, count: bool = True) -> MatchResult:
        """The cached prefix that admission takes for the request (nothing is locked)."""
        # Always compute at least one token, so there are logits to sample from; a request
        # that wants prompt logprobs computes its whole prompt.
        end = 0 if req.params.prompt_logprobs is not None else req.num_tokens - 1
        return self.cache.match_prefix(req.token_slice(0, end), count=count)

    def allocate(self, req: Req, new_tokens: int) -> bool:
        """Make room in the row for ``new_tokens`` more tokens after kv_len."""
        return self.allocate_batch([req], [new_tokens])

    def pages_needed(self, reqs: list[Req], new_tokens: list[int]) -> list[int]:
        """pages_for of each request (inlined: this runs over every decode row each step)."""
        ps = self.page_size
        return [max(0, -(-(r.kv_len + n - r.alloc_len) // ps)) for r, n in zip(reqs, new_tokens)]

    def allocate_batch(
        self, reqs: list[Req], new_tokens: list[int], needs: list[int] | None = None
    ) -> bool:
        """Allocate for many requests with one allocator call and one table write.

        All or nothing: returns False (allocating nothing) if the pages are not there.
        ``needs`` may pass pages_needed(reqs, new_tokens) when the caller has it.
        """
        if needs is None:
            needs = self.pages_needed(reqs, new_tokens)
        total = sum(needs)
        if total == 0:
            return True
        pages = self._alloc(total)
        if pages is None:
            return False
        ps = self.page_size
        slots = PageAllocator.pages_to_slots(pages, ps)
        rows, starts, lens = [], [], []
        for r, k in zip(reqs, needs):
            if k:
                rows.append(r.row)
                starts.append(r.alloc_len)
                lens.append(k * ps)
                r.alloc_len += k * ps
        row_idx, col_idx = ranges(rows, starts, lens)
        self.host_table[row_idx, col_idx] = slots
        self._dirty.append((row_idx, col_idx))
        return True

    def cache_prefix(self, req: Req) -> None:
        """Hand the computed, page-aligned prefix to the prefix cache (request keeps it locked)."""
        if not self.reuse:
            return
        n = self.cacheable(req) // self.page_size * self.page_size
        if n <= req.tree_len:
            return
        tokens = req.token_slice(0, n)
        row = self.host_table[req.row]
        present = self.cache.insert(tokens, row[:n].clone())
        if present > req.tree_len:
            # Someone cached these tokens first: free our copies and point at theirs
            # (the page table must never keep pointing at pages we gave back).
            self.allocator.free(row[req.tree_len : present : self.page_size] // self.page_size)
        match = self.cache.match_prefix(tokens, count=False)
        assert match.length == n, (match.length, n)
        if present > req.tree_len:
            row[req.tree_len : present] = match.slots[req.tree_len : present]
            self._dirty.append(ranges([req.row], [req.tree_len], [present - req.tree_len]))
        self.cache.lock(match.node)
        self.cache.unlock(req.tree_node)
        req.tree_node, req.tree_len = match.node, n

    def release(self, req: Req) -> None:
        """Cache what the request computed, unlock its prefix, free its private pages and row."""
        if req.row < 0:
            return
        self.cache_prefix(req)
        private = self.host_table[req.row, req.tree_len : req.alloc_len : self.page_size]
        if len(private):
            self.allocator.free(private // self.page_size)
        self.cache.unlock(req.tree_node)
        self.free_rows.append(req.row)
        req.row, req.tree_node = -1, None
        req.kv_len = req.alloc_len = req.tree_len = 0

    # ------------------------------------------------------------ device mirror
    def take_updates(self) -> TableUpdate | None:
        """The host table's changes since the last call, for the device copy (None: none,
        or the table lives on the host); the step that carries them writes them."""
        dirty, self._dirty = self._dirty, []
        if not dirty or self.device_table is self.host_table:
            return None
        rows = torch.cat([r for r, _ in dirty]) if len(dirty) > 1 else dirty[0][0]
        cols = torch.cat([c for _, c in dirty]) if len(dirty) > 1 else dirty[0][1]
        return TableUpdate(rows, cols, self.host_table[rows, cols])

    def flush(self) -> None:
        """Write the host table's changes to the device table now (one staged copy)."""
        update = self.take_updates()
        if update is not None:
            staged = self.stager.stage([update.rows, update.cols, update.values], torch.long)
            self.device_table[staged[0], staged[1]] = staged[2]

    def slots(self, req: Req, start: int, end: int) -> torch.Tensor:
        return self.host_table[req.row, start:end]

    # ------------------------------------------------------------ checks
    def private_pages(self, reqs: Iterable[Req]) -> list[int]:
        pages: list[int] = []
        for r in reqs:
            if r.row >= 0:
                pages += (
                    self.host_table[r.row, r.tree_len : r.alloc_len : self.page_size]
                    // self.page_size
                ).tolist()
        return pages

    def _check_row_prefix(self, r: Req) -> None:
        """The row's first tree_len slots are the locked tree node's path, for the request's
        own tokens (upstream mini-sglang #142: a row kept pointing at pages given back when
        another request had cached the same prefix first)."""
        tokens, values = _path(r.tree_node)
        assert len(tokens) == r.tree_len and tokens == r.token_slice(0, r.tree_len), (
            f"request {r.uid}'s locked prefix is not its own first {r.tree_len} tokens"
        )
        slots = torch.cat(values) if values else self.host_table.new_empty(0)
        assert torch.equal(self.host_table[r.row, : r.tree_len], slots), (
            f"request {r.uid}'s page-table row does not point at its cached prefix's pages"
        )

    def check_integrity(self, live: Iterable[Req]) -> None:
        live = list(live)
        self.cache.check_integrity(in_use_pages=self.private_pages(live))
        rows = [r.row for r in live if r.row >= 0]
        assert len(set(rows)) == len(rows), "a page-table row is owned twice"
        if self.reuse:
            for r in live:
                if r.row >= 0 and r.tree_node is not None:
                    self._check_row_prefix(r)
        assert len(rows) + len(self.free_rows) == self.max_requests, (
            f"row leak: {len(rows)} live + {len(self.free_rows)} free != {self.max_requests}"
        )


def _kv_len(req: Req) -> int:
    return req.kv_len


def _path(node: object) -> tuple[list[int], list[torch.Tensor]]:
    """Tokens and slots from the root down to a radix ``node`` (walked up: nothing in the tree
    moves); none for another cache's handle."""
    keys: list[list[int]] = []
    values: list[torch.Tensor] = []
    while isinstance(node, RadixNode) and node.parent is not None:
        keys.append(node.key)
        values.append(node.value)
        node = node.parent
    tokens = [t for k in reversed(keys) for t in k]
    return tokens, values[::-1]


def ranges(
    rows: list[int], starts: list[int], lens: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column indices of the table entries rows[i], starts[i] : starts[i] + lens[i]."""
    if len(rows) == 1:  # one row (batch 1): two ops, not the general gather's seven
        return (
            torch.full((lens[0],), rows[0], dtype=torch.int64),
            torch.arange(starts[0], starts[0] + lens[0], dtype=torch.int64),
        )
    # numpy: torch.repeat_interleave costs ~100 us per call on the host, this a few us.
    n = np.asarray(lens, dtype=np.int64)
    row_idx = np.repeat(np.asarray(rows, dtype=np.int64), n)
    offsets = np.repeat(np.asarray(starts, dtype=np.int64) - (np.cumsum(n) - n), n)
    col_idx = np.arange(int(n.sum()), dtype=np.int64) + offsets
    return torch.from_numpy(row_idx), torch.from_numpy(col_idx)
