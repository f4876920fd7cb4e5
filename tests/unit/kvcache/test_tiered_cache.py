"""The radix cache over two tiers (device pool + HiCache's host tier), driven by hypothesis.

Every token's K/V is written as a value derived from its whole prefix (an independent
reference: the same prefix always has the same K/V, whoever computed it). After every step:
the integrity check of both tiers (each page free, cached or in use on exactly one side,
no double free: the allocators raise on one), every cached node's device and host copies
hold its prefix's reference K/V, byte for byte equal to each other, and a flush empties both
pools.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minisgl.extensions.hicache.host_tier import HostTier
from minisgl.kvcache.allocator import PageAllocator
from minisgl.kvcache.pool import KVPool
from minisgl.kvcache.radix_node import RadixNode
from minisgl.kvcache.tiered_cache import TieredRadixCache

LAYERS, DIM = 2, 2
# Prompts share prefixes (a base cut anywhere) so that whole pages match, at page size 4 too.
BASES = [[(7 * b + 3 * i) % 11 for i in range(16)] for b in range(3)]
PROMPTS = st.builds(
    lambda b, cut, tail: BASES[b][:cut] + tail,
    st.integers(0, 2),
    st.integers(0, 16),
    st.lists(st.integers(0, 3), max_size=6),
).filter(bool)


def reference_kv(prefix: list[int]) -> torch.Tensor:
    """[2, LAYERS, DIM]: the K/V of a prefix's last token (exact in fp32)."""
    v = float(hash(tuple(prefix)) % 100003)
    kv = torch.arange(2).view(2, 1, 1) * 0.125
    layer = torch.arange(LAYERS).view(1, LAYERS, 1) * 0.25
    return v + kv + layer + torch.arange(DIM).view(1, 1, DIM) * 0.0625


def write_kv(pool: KVPool, tokens: list[int], start: int, slots: torch.Tensor) -> None:
    for i, slot in enumerate(slots.tolist()):
        pool.buffer[:, :, slot, 0, :] = reference_kv(tokens[: start + i + 1])


def make(num_pages: int, page_size: int, host: int, write_through: bool) -> TieredRadixCache:
    pool = KVPool(LAYERS, num_pages + 1, page_size, 1, DIM, torch.float32, torch.device("cpu"))
    tier = HostTier(pool, host, write_through)
    return TieredRadixCache(PageAllocator(num_pages, page_size), tier)


def node_tokens(node: RadixNode) -> list[int]:
    keys = []
    cur: RadixNode | None = node
    while cur is not None and cur.parent is not None:
        keys.append(cur.key)
        cur = cur.parent
    return [t for k in reversed(keys) for t in k]


def check_contents(cache: TieredRadixCache) -> None:
    tier = cache.tier
    assert isinstance(tier, HostTier)
    tier.settle()  # saves reach the host pages late (as on CUDA)
    for node in cache._iter_nodes():
        tokens = node_tokens(node)
        start = len(tokens) - len(node.key)
        want = torch.stack([reference_kv(tokens[: start + i + 1]) for i in range(len(node.key))])
        copies = []
        if node.value.numel():
            copies.append(tier.pool.buffer[:, :, node.value, 0, :])
        if node.host is not None:
            copies.append(tier.host_kv(node.host)[:, :, :, 0, :])
        for copy in copies:  # [2, LAYERS, n, DIM] vs [n, 2, LAYERS, DIM]
            assert torch.equal(copy.permute(2, 0, 1, 3), want), f"node {node.node_id} K/V"
        if len(copies) == 2:
            assert copies[0].numpy().tobytes() == copies[1].numpy().tobytes()


def test_evicted_prefix_comes_back_from_host() -> None:
    cache = make(num_pages=12, page_size=1, host=16, write_through=False)
    a, b = [1, 2, 3, 4, 5, 6], [9, 8, 7, 6, 5, 4]
    for tokens in (a, b):
        pages = cache.allocator.alloc(len(tokens))
        assert pages is not None
        write_kv(cache.tier.pool, tokens, 0, pages)  # type: ignore[attr-defined]
        cache.insert(tokens, pages)
    cache.check_integrity()
    assert cache.evict(6) == 6  # a, the older, leaves the device for the host
    match = cache.match_prefix(a)
    assert (match.length, match.host_length) == (0, 6)
    loaded = cache.load(match)
    assert (loaded.length, loaded.host_length) == (6, 0)
    cache.check_integrity()
    check_contents(cache)
    cache.reset()
    assert cache.allocator.num_free_pages == 12 and cache.tier.num_free_pages == 16


@dataclass
class Active:
    tokens: list[int]
    node: object
    start: int  # tokens [0, start) are the locked cached prefix
    pages: torch.Tensor  # private pages for [start, len(tokens))


class TieredMachine(RuleBasedStateMachine):
    page_size, device_pages, host_pages = 1, 24, 10
    write_through = False

    def __init__(self) -> None:
        super().__init__()
        self.cache = make(self.device_pages, self.page_size, self.host_pages, self.write_through)
        self.pool = self.cache.tier.pool  # type: ignore[attr-defined]
        self.active: list[Active] = []

    def _private(self) -> list[int]:
        return [p for a in self.active for p in a.pages.tolist()]

    @rule(tokens=PROMPTS, load=st.booleans())
    def start(self, tokens: list[int], load: bool) -> None:
        """A request: match (loading its host part, or not), lock, allocate, compute."""
        cache, ps = self.cache, self.page_size
        match = cache.match_prefix(tokens)
        if load:
            match = cache.load(match)
        cache.lock(match.node)
        n = -(-(len(tokens) - match.length) // ps)
        if n > cache.allocator.num_free_pages:
            cache.evict(n - cache.allocator.num_free_pages)
        pages = cache.allocator.alloc(n)
        if pages is None:
            cache.unlock(match.node)
            return
        slots = PageAllocator.pages_to_slots(pages, ps)[: len(tokens) - match.length]
        write_kv(self.pool, tokens, match.length, slots)
        self.active.append(Active(tokens, match.node, match.length, pages))

    @precondition(lambda self: self.active)
    @rule(i=st.integers(0, 10), abort=st.booleans())
    def finish(self, i: int, abort: bool) -> None:
        """The request ends: cached (its duplicates freed) or aborted (all private pages
        freed)."""
        a = self.active.pop(i % len(self.active))
        cache, ps = self.cache, self.page_size
        if abort:
            cache.allocator.free(a.pages)
            cache.unlock(a.node)
            return
        prefix = cache.match_prefix(a.tokens[: a.start], count=False).slots
        own = PageAllocator.pages_to_slots(a.pages, ps)[: len(a.tokens) - a.start]
        present = cache.insert(a.tokens, torch.cat([prefix, own]))
        aligned = len(a.tokens) - len(a.tokens) % ps
        mine = a.pages.tolist()
        dup = mine[: max(0, present - a.start) // ps]
        tail = mine[(aligned - a.start) // ps :] if aligned >= a.start else mine
        cache.allocator.free(torch.tensor(dup + tail, dtype=torch.int64))
        cache.unlock(a.node)

    @rule(n=st.integers(1, 12))
    def evict(self, n: int) -> None:
        self.cache.evict(n)

    @rule(tokens=PROMPTS)
    def match(self, tokens: list[int]) -> None:
        match = self.cache.match_prefix(tokens)
        assert match.slots.numel() == match.length
        assert match.length + match.host_length <= len(tokens)

    @precondition(lambda self: not self.active)
    @rule()
    def flush(self) -> None:
        self.cache.reset()
        assert self.cache.allocator.num_free_pages == self.device_pages
        assert self.cache.tier.num_free_pages == self.host_pages

    @invariant()
    def consistent(self) -> None:
        self.cache.check_integrity(self._private())
        check_contents(self.cache)


class TieredMachinePage4WriteThrough(TieredMachine):
    page_size, device_pages, host_pages = 4, 8, 5
    write_through = True


class TieredMachinePage1WriteThrough(TieredMachine):
    write_through = True


class TieredMachinePage4(TieredMachine):
    page_size, device_pages, host_pages = 4, 8, 5


_settings = settings(
    max_examples=60,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTieredPage1 = TieredMachine.TestCase
TestTieredPage4 = TieredMachinePage4.TestCase
TestTieredPage1WriteThrough = TieredMachinePage1WriteThrough.TestCase
TestTieredPage4WriteThrough = TieredMachinePage4WriteThrough.TestCase
for case in (TestTieredPage1, TestTieredPage4, TestTieredPage1WriteThrough):
    case.settings = _settings
TestTieredPage4WriteThrough.settings = _settings


@pytest.mark.parametrize("write_through", [False, True])
def test_full_host_drops_whole_nodes(write_through: bool) -> None:
    """A host tier smaller than the evicted set: LRU whole nodes leave the tree; what stays
    is consistent."""
    cache = make(num_pages=6, page_size=1, host=4, write_through=write_through)
    for base in range(5):
        tokens = [base, base + 10, base + 20]
        match = cache.match_prefix(tokens)
        n = 3 - match.length
        if n > cache.allocator.num_free_pages:
            cache.evict(n - cache.allocator.num_free_pages)
        pages = cache.allocator.alloc(n)
        assert pages is not None
        write_kv(cache.tier.pool, tokens, 0, pages)  # type: ignore[attr-defined]
        cache.insert(tokens, pages)
        cache.check_integrity()
        check_contents(cache)
    assert cache.match_prefix([4, 14, 24]).length == 3  # the newest stays on the device
    assert cache.match_prefix([0, 10, 20]).host_length == 0  # the oldest is gone
