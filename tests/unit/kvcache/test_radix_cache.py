from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from minisgl.kvcache.allocator import PageAllocator
from minisgl.kvcache.naive_cache import NaiveCache
from minisgl.kvcache.prefix_cache import PrefixCache
from minisgl.kvcache.radix_cache import RadixCache


def make_cache(num_pages: int = 64, page_size: int = 1) -> tuple[PageAllocator, RadixCache]:
    allocator = PageAllocator(num_pages, page_size)
    return allocator, RadixCache(allocator)


def serve(cache: PrefixCache, allocator: PageAllocator, tokens: list[int]) -> tuple[int, int]:
    """Run one request through match -> lock -> alloc -> insert -> free -> unlock.

    Returns (matched prefix length, length insert() reported as already present).
    """
    ps = allocator.page_size
    match = cache.match_prefix(tokens)
    cache.lock(match.node)
    num_new = len(tokens) - match.length
    pages = allocator.alloc(-(-num_new // ps))
    assert pages is not None, "test cache too small"
    slots = torch.cat([match.slots, PageAllocator.pages_to_slots(pages, ps)[:num_new]])
    present = cache.insert(tokens, slots)
    aligned = len(tokens) - len(tokens) % ps
    # Free our duplicates [prefix, present) and the partial tail [aligned, len).
    own = pages.tolist()
    if not cache.stores_inserted:  # the naive cache kept nothing: free every page
        allocator.free(pages)
        cache.unlock(match.node)
        cache.check_integrity()
        return match.length, present
    dup = own[: (present - match.length) // ps]
    tail = own[(aligned - match.length) // ps :]
    allocator.free(torch.tensor(dup + tail, dtype=torch.int64))
    cache.unlock(match.node)
    cache.check_integrity()
    return match.length, present


# ---------------------------------------------------------------- match / insert
def test_empty_cache_matches_nothing() -> None:
    allocator, cache = make_cache()
    match = cache.match_prefix([1, 2, 3])
    assert match.length == 0 and match.slots.numel() == 0
    cache.lock(match.node)  # locking the root is harmless
    cache.unlock(match.node)
    cache.check_integrity()


def test_insert_then_match_returns_inserted_slots() -> None:
    allocator, cache = make_cache()
    slots = torch.tensor([10, 11, 12, 13])
    allocator.alloc(64)  # own every page, then hand the inserted ones to the tree
    assert cache.insert([1, 2, 3, 4], slots) == 0
    match = cache.match_prefix([1, 2, 3, 4, 5])
    assert match.length == 4
    assert match.slots.tolist() == [10, 11, 12, 13]
    assert match.slots.dtype == torch.int64
    cache.check_integrity(in_use_pages=set(range(64)) - {10, 11, 12, 13})


def test_partial_match_splits_node() -> None:
    allocator, cache = make_cache()
    serve(cache, allocator, [1, 2, 3, 4, 5, 6])
    match = cache.match_prefix([1, 2, 3, 9])
    assert match.length == 3
    assert match.slots.tolist() == [0, 1, 2]
    cache.check_integrity()
    # Both halves of the split node are still reachable.
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots.tolist() == [0, 1, 2, 3, 4, 5]
    assert cache.evictable_pages == 6


def test_insert_return_values() -> None:
    allocator, cache = make_cache()
    assert serve(cache, allocator, [1, 2, 3, 4]) == (0, 0)
    assert serve(cache, allocator, [1, 2, 3, 4, 5, 6]) == (4, 4)
    assert serve(cache, allocator, [1, 2, 7]) == (2, 2)
    assert serve(cache, allocator, [1, 2, 7]) == (3, 3)
    assert cache.evictable_pages == 7  # 1 2 3 4 5 6 + 7
    # Inserting a fully cached sequence with other slots keeps the tree's slots.
    assert cache.insert([1, 2, 3], torch.tensor([50, 51, 52])) == 3
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == [0, 1, 2]


def test_insert_copies_caller_slots() -> None:
    allocator, cache = make_cache(num_pages=8)
    pages = allocator.alloc(3)
    assert pages is not None
    row = pages.clone()
    cache.insert([5, 6, 7], row)
    row.fill_(-1)  # the scheduler reuses its page-table rows
    assert cache.match_prefix([5, 6, 7]).slots.tolist() == pages.tolist()


def test_token_ids_may_be_tensor_or_tuple() -> None:
    allocator, cache = make_cache()
    serve(cache, allocator, [3, 1, 4, 1, 5])
    assert cache.match_prefix(torch.tensor([3, 1, 4, 9])).length == 3  # type: ignore[arg-type]
    assert cache.match_prefix((3, 1, 4, 1, 5)).length == 5


def test_long_prompt_mismatch_deep_inside_node() -> None:
    allocator, cache = make_cache(num_pages=2048, page_size=4)
    tokens = [i % 97 for i in range(8000)]
    serve(cache, allocator, tokens)
    probe = tokens[:5001] + [-1] + tokens[5002:]
    match = cache.match_prefix(probe)
    assert match.length == 5000  # mismatch at 5001 rounds down to the page boundary
    assert match.slots.tolist() == list(range(5000))
    cache.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4])
def test_partial_pages_never_inserted_or_matched(page_size: int) -> None:
    allocator, cache = make_cache(num_pages=32, page_size=page_size)
    tokens = list(range(10))
    aligned = 10 - 10 % page_size
    assert serve(cache, allocator, tokens) == (0, 0)
    assert cache.evictable_pages == aligned // page_size
    assert cache.match_prefix(tokens).length == aligned
    assert cache.match_prefix(tokens[:7]).length == 7 - 7 % page_size
    # Diverging inside the second page only matches the first page.
    diverged = tokens[:5] + [99] + tokens[6:]
    assert cache.match_prefix(diverged).length == 5 - 5 % page_size
    assert cache.match_prefix(tokens[:3]).length == 3 - 3 % page_size
    cache.check_integrity()


def test_page_size_4_insert_splits_at_page_boundary() -> None:
    allocator, cache = make_cache(num_pages=32, page_size=4)
    a = list(range(12))
    b = a[:6] + [100] * 6  # diverges mid second page
    serve(cache, allocator, a)
    assert serve(cache, allocator, b) == (4, 4)
    match = cache.match_prefix(b)
    assert match.length == 12
    assert match.slots[:4].tolist() == [0, 1, 2, 3]
    assert len(set(match.slots[4:].tolist()) & set(range(12))) == 0
    cache.check_integrity()


# ------------------------------------------------------------ lock / eviction
def test_lock_protects_path_from_eviction() -> None:
    allocator, cache = make_cache(num_pages=16)
    serve(cache, allocator, [1, 2, 3])
    serve(cache, allocator, [4, 5])
    match = cache.match_prefix([1, 2, 3])
    cache.lock(match.node)
    assert (cache.evictable_pages, cache.protected_pages) == (2, 3)
    assert cache.evict(100) == 2
    assert cache.match_prefix([1, 2, 3]).length == 3
    assert cache.match_prefix([4, 5]).length == 0
    cache.check_integrity()
    cache.unlock(match.node)
    assert (cache.evictable_pages, cache.protected_pages) == (3, 0)
    assert cache.evict(1) == 3  # whole leaves are evicted
    assert allocator.num_free_pages == 16
    cache.check_integrity()


def test_unlock_below_zero_raises() -> None:
    allocator, cache = make_cache()
    serve(cache, allocator, [1, 2])
    node = cache.match_prefix([1, 2]).node
    with pytest.raises(AssertionError, match="below zero"):
        cache.unlock(node)


def test_lock_survives_split_of_locked_node() -> None:
    allocator, cache = make_cache()
    serve(cache, allocator, [1, 2, 3, 4, 5, 6])
    deep = cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.lock(deep.node)
    cache.match_prefix([1, 2, 3, 7])  # splits the locked node
    cache.check_integrity()
    assert cache.protected_pages == 6 and cache.evict(6) == 0
    cache.unlock(deep.node)
    assert cache.protected_pages == 0 and cache.evict(6) == 6
    cache.check_integrity()


def test_lock_on_evicted_node_raises() -> None:
    allocator, cache = make_cache()
    serve(cache, allocator, [1, 2])
    node = cache.match_prefix([1, 2]).node
    assert cache.evict(2) == 2
    with pytest.raises(AssertionError, match="evicted"):
        cache.lock(node)


def test_evict_lru_leaf_first() -> None:
    allocator, cache = make_cache(num_pages=16)
    serve(cache, allocator, [1, 1])
    serve(cache, allocator, [2, 2])
    serve(cache, allocator, [3, 3])
    cache.match_prefix([1, 1])  # now [2, 2] is the least recently used
    assert cache.evict(1) == 2
    assert [cache.match_prefix(t).length for t in ([1, 1], [2, 2], [3, 3])] == [2, 0, 2]


def test_evicting_child_exposes_parent_in_same_call() -> None:
    allocator, cache = make_cache(num_pages=16)
    serve(cache, allocator, [1, 2, 3, 4])
    serve(cache, allocator, [1, 2, 5, 6])  # root -> [1 2] -> {[3 4], [5 6]}
    serve(cache, allocator, [9, 9, 9])  # most recent
    assert cache.evict(5) == 6  # both children, then their parent; [9 9 9] stays
    assert cache.match_prefix([9, 9, 9]).length == 3
    assert cache.match_prefix([1, 2]).length == 0
    cache.check_integrity()


def test_split_refreshes_matched_part_only() -> None:
    """Pinned regression for the split-recency bug (mini-sglang PR #124).

    A = [1..6] is inserted first, B = [7 8 9] later; then a match of A's first half
    splits A. The matched head was just used, A's unmatched tail was not. Correct
    LRU evicts A's tail, then B, and keeps A's head. The buggy rule (the new parent
    keeps A's old timestamp) would evict A's head before B.
    """
    allocator, cache = make_cache(num_pages=16)
    serve(cache, allocator, [1, 2, 3, 4, 5, 6])  # A
    serve(cache, allocator, [7, 8, 9])  # B
    assert cache.match_prefix([1, 2, 3]).length == 3  # splits A; refreshes the head only
    cache.check_integrity()
    assert cache.evict(3) == 3
    assert cache.match_prefix([7, 8, 9, 0]).length == 3, "B must outlive A's stale tail"
    allocator2, cache2 = make_cache(num_pages=16)
    serve(cache2, allocator2, [1, 2, 3, 4, 5, 6])
    serve(cache2, allocator2, [7, 8, 9])
    cache2.match_prefix([1, 2, 3])
    assert cache2.evict(3) == 3  # A's tail (least recently used)
    assert cache2.evict(3) == 3  # then B, not A's refreshed head
    assert cache2.match_prefix([7, 8, 9]).length == 0
    assert cache2.match_prefix([1, 2, 3, 4]).length == 3
    cache2.check_integrity()


def test_reset_returns_all_pages() -> None:
    allocator, cache = make_cache(num_pages=16, page_size=2)
    serve(cache, allocator, [1, 2, 3, 4])
    serve(cache, allocator, [1, 2, 5, 6, 7])
    cache.match_prefix([1, 2])
    cache.reset()
    assert allocator.num_free_pages == 16
    assert cache.evictable_pages == 0 and cache.match_prefix([1, 2]).length == 0
    cache.check_integrity()


def test_reset_while_locked_raises() -> None:
    allocator, cache = make_cache()
    serve(cache, allocator, [1, 2])
    cache.lock(cache.match_prefix([1, 2]).node)
    with pytest.raises(AssertionError, match="locked"):
        cache.reset()


def test_check_integrity_detects_leak_and_double_ownership() -> None:
    allocator, cache = make_cache(num_pages=8)
    serve(cache, allocator, [1, 2])
    pages = allocator.alloc(1)
    assert pages is not None
    with pytest.raises(AssertionError, match="leak"):
        cache.check_integrity()
    cache.check_integrity(in_use_pages=pages.tolist())
    with pytest.raises(AssertionError, match="both"):
        cache.check_integrity(in_use_pages=pages.tolist() + [0])


# ---------------------------------------------------------------- counters
def test_hit_counters() -> None:
    allocator, cache = make_cache(num_pages=16, page_size=2)
    assert cache.stats.hit_rate == 0.0
    serve(cache, allocator, [1, 2, 3, 4])  # looks up 4, matches 0
    cache.match_prefix([1, 2, 3, 9, 9])  # looks up 5, matches 2
    stats = cache.stats
    assert (stats.looked_up_tokens, stats.matched_tokens) == (9, 2)
    assert stats.hit_rate == pytest.approx(2 / 9)


# ---------------------------------------------------------------- naive cache
def test_naive_cache_never_reuses() -> None:
    allocator = PageAllocator(8, 2)
    cache = NaiveCache(allocator)
    assert cache.page_size == 2 and not cache.stores_inserted
    assert serve(cache, allocator, [1, 2, 3, 4]) == (0, 0)
    assert serve(cache, allocator, [1, 2, 3, 4]) == (0, 0)
    match = cache.match_prefix([1, 2, 3, 4])
    assert match.length == 0 and match.slots.numel() == 0
    assert allocator.num_free_pages == 8
    assert cache.evict(4) == 0
    assert (cache.evictable_pages, cache.protected_pages) == (0, 0)
    assert (cache.stats.looked_up_tokens, cache.stats.matched_tokens) == (0, 0)
    pages = allocator.alloc(2)
    assert pages is not None
    cache.check_integrity(in_use_pages=pages.tolist())
    with pytest.raises(AssertionError, match="leak"):
        cache.check_integrity()
    cache.reset()


# ------------------------------------------------------- stateful model test
# Token sequences are a cut of one of a few fixed bases plus a random suffix over
# a tiny alphabet, so prefixes collide often and diverge at arbitrary (also
# mid-page) positions.
BASE_LEN = 32
BASES = (
    [0] * BASE_LEN,
    [i % 3 for i in range(BASE_LEN)],
    [(i * i) % 3 for i in range(BASE_LEN)],
)


def _join(base: list[int], cut: int, suffix: list[int]) -> list[int]:
    return base[:cut] + suffix


token_seqs = st.builds(
    _join,
    st.sampled_from(BASES),
    st.integers(0, BASE_LEN),
    st.lists(st.integers(0, 2), max_size=12),
)


@dataclass
class LiveRequest:
    tokens: list[int]
    prefix_slots: torch.Tensor  # slots of the cached prefix (owned by the tree, locked)
    prefix_node: object
    pages: torch.Tensor  # private pages for tokens[len(prefix_slots):]


class RadixCacheMachine(RuleBasedStateMachine):
    page_size = 1
    num_pages = 48

    def __init__(self) -> None:
        super().__init__()
        self.allocator = PageAllocator(self.num_pages, self.page_size)
        self.cache = RadixCache(self.allocator)
        self.slot_token: dict[int, int] = {}  # which token's KV each written slot holds
        self.requests: list[LiveRequest] = []
        self.pins: list[object] = []

    # -- helpers
    def _check_match(self, tokens: list[int], slots: torch.Tensor, length: int) -> None:
        assert length % self.page_size == 0 and 0 <= length <= len(tokens)
        assert slots.dtype == torch.int64 and slots.numel() == length
        for i, slot in enumerate(slots.tolist()):
            assert self.slot_token.get(slot) == tokens[i], f"slot {slot} holds the wrong token"

    def _free(self, pages: torch.Tensor) -> None:
        for slot in PageAllocator.pages_to_slots(pages, self.page_size).tolist():
            self.slot_token.pop(slot, None)
        self.allocator.free(pages)

    def _private_slots(self, req: LiveRequest) -> torch.Tensor:
        num_new = len(req.tokens) - req.prefix_slots.numel()
        return PageAllocator.pages_to_slots(req.pages, self.page_size)[:num_new]

    # -- rules
    @rule(tokens=token_seqs)
    def new_request(self, tokens: list[int]) -> None:
        match = self.cache.match_prefix(tokens)
        self._check_match(tokens, match.slots, match.length)
        self.cache.lock(match.node)
        num_pages = -(-(len(tokens) - match.length) // self.page_size)
        pages = self.allocator.alloc(num_pages)
        if pages is None:
            self.cache.evict(num_pages - self.allocator.num_free_pages)
            pages = self.allocator.alloc(num_pages)
        if pages is None:  # out of memory even after eviction: reject the request
            self.cache.unlock(match.node)
            return
        req = LiveRequest(tokens, match.slots, match.node, pages)
        for slot, token in zip(
            self._private_slots(req).tolist(), tokens[match.length :], strict=True
        ):
            self.slot_token[slot] = token  # "the forward pass writes the KV"
        self.requests.append(req)

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 1000))
    def finish_request(self, index: int) -> None:
        req = self.requests.pop(index % len(self.requests))
        ps, prefix = self.page_size, req.prefix_slots.numel()
        slots = torch.cat([req.prefix_slots, self._private_slots(req)])
        present = self.cache.insert(req.tokens, slots)
        aligned = len(req.tokens) - len(req.tokens) % ps
        assert present % ps == 0 and prefix <= present <= aligned
        # Our pages for [prefix, present) duplicate the tree's; the tail is partial.
        self._free(req.pages[: (present - prefix) // ps])
        self._free(req.pages[(aligned - prefix) // ps :])
        self.cache.unlock(req.prefix_node)
        match = self.cache.match_prefix(req.tokens)
        assert match.length == aligned
        self._check_match(req.tokens, match.slots, match.length)
        assert torch.equal(match.slots[:prefix], req.prefix_slots)
        assert torch.equal(match.slots[present:aligned], slots[present:aligned])

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 1000))
    def abort_request(self, index: int) -> None:
        req = self.requests.pop(index % len(self.requests))
        self._free(req.pages)
        self.cache.unlock(req.prefix_node)

    @rule(tokens=token_seqs)
    def pin(self, tokens: list[int]) -> None:
        match = self.cache.match_prefix(tokens)
        self._check_match(tokens, match.slots, match.length)
        self.cache.lock(match.node)
        self.pins.append(match.node)

    @precondition(lambda self: self.pins)
    @rule(index=st.integers(0, 1000))
    def unpin(self, index: int) -> None:
        self.cache.unlock(self.pins.pop(index % len(self.pins)))

    @rule(num_pages=st.integers(0, 64))
    def evict(self, num_pages: int) -> None:
        free_before = self.allocator.num_free_pages
        evictable_before = self.cache.evictable_pages
        protected_before = self.cache.protected_pages
        freed = self.cache.evict(num_pages)
        assert freed >= min(num_pages, evictable_before)
        assert self.allocator.num_free_pages == free_before + freed
        assert self.cache.evictable_pages == evictable_before - freed
        assert self.cache.protected_pages == protected_before

    @invariant()
    def integrity(self) -> None:
        in_use = [page for req in self.requests for page in req.pages.tolist()]
        self.cache.check_integrity(in_use_pages=in_use)

    def teardown(self) -> None:
        while self.requests:
            self.abort_request(0)
        while self.pins:
            self.unpin(0)
        assert self.cache.protected_pages == 0
        self.cache.check_integrity()
        self.cache.reset()
        assert self.allocator.num_free_pages == self.num_pages


class RadixCacheMachinePage4(RadixCacheMachine):
    page_size = 4
    num_pages = 24


_stateful_settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
TestRadixCacheStatefulPage1 = RadixCacheMachine.TestCase
TestRadixCacheStatefulPage1.settings = _stateful_settings
TestRadixCacheStatefulPage4 = RadixCacheMachinePage4.TestCase
TestRadixCacheStatefulPage4.settings = _stateful_settings
