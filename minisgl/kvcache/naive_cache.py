"""A prefix cache that caches nothing (prefix reuse disabled)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from minisgl.kvcache.allocator import PageAllocator
from minisgl.kvcache.prefix_cache import (
    CacheStats,
    MatchResult,
    PrefixCache,
    check_page_accounting,
    empty_slots,
)


class NaiveCache(PrefixCache):
    """Never matches and never stores: every request owns, and later frees, all its pages."""

    stores_inserted = False

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size

    def match_prefix(self, token_ids: Sequence[int], count: bool = True) -> MatchResult:
        return MatchResult(node=None, length=0, slots=empty_slots())

    def lock(self, node: object) -> None:
        pass

    def unlock(self, node: object) -> None:
        pass

    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int:
        # Nothing was already present and nothing is kept, so the caller frees all its pages.
        return 0

    def evict(self, num_pages: int) -> int:
        return 0

    @property
    def evictable_pages(self) -> int:
        return 0

    @property
    def protected_pages(self) -> int:
        return 0

    def check_integrity(self, in_use_pages: Iterable[int] = ()) -> None:
        check_page_accounting(self.allocator, [], in_use_pages)

    def reset(self) -> None:
        pass

    @property
    def stats(self) -> CacheStats:
        return CacheStats()
