"""The interface shared by the prefix caches (radix and naive)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch


@dataclass(frozen=True)
class MatchResult:
    """The longest page-aligned cached prefix of a token sequence.

    ``node`` is an opaque handle to pass to ``lock``/``unlock``; ``slots`` holds
    the token slots (int64, CPU) of the first ``length`` tokens. With a second tier
    (tier.py), the next ``host_length`` tokens are cached only there, down to
    ``host_node``: ``PrefixCache.load`` brings them to the device.
    """

    node: object
    length: int
    slots: torch.Tensor
    host_length: int = 0
    host_node: object = None


@dataclass(frozen=True)
class CacheStats:
    """Token counters for the global prefix hit rate."""

    looked_up_tokens: int = 0
    matched_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        if self.looked_up_tokens == 0:
            return 0.0
        return self.matched_tokens / self.looked_up_tokens


def empty_slots() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


class PagePool(Protocol):
    """What the accounting check reads of a pool of pages (a `PageAllocator`, a tier)."""

    num_pages: int

    def free_pages_set(self) -> set[int]: ...


def check_page_accounting(
    allocator: PagePool, tree_pages: list[int], in_use_pages: Iterable[int]
) -> None:
    """Every page is in exactly one place: the free list, the cache, or a request."""
    free = allocator.free_pages_set()
    in_use = list(in_use_pages)
    owner: dict[int, str] = {}
    for where, pages in (("free list", list(free)), ("tree", tree_pages), ("in use", in_use)):
        for page in pages:
            assert 0 <= page < allocator.num_pages, f"page {page} ({where}) is out of range"
            assert page not in owner, f"page {page} is both in the {owner[page]} and the {where}"
            owner[page] = where
    total = len(free) + len(tree_pages) + len(in_use)
    assert total == allocator.num_pages, (
        f"page leak: free {len(free)} + tree {len(tree_pages)} + in use {len(in_use)} "
        f"= {total} != {allocator.num_pages} pages"
    )


class PrefixCache(ABC):
    """CPU-side index from token prefixes to the KV slots that hold them."""

    page_size: int
    # False when insert() keeps nothing (NaiveCache): the caller then frees ALL its
    # pages at finish, not just the duplicates [prefix, returned length) and the tail.
    stores_inserted: ClassVar[bool] = True

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int], count: bool = True) -> MatchResult:
        """Longest page-aligned cached prefix; refreshes recency along the matched path.

        ``count=False`` leaves the hit-rate counters alone (internal re-lookups)."""

    def load(self, match: MatchResult) -> MatchResult:
        """Bring the match's tier-only part to the device (as much as device pages allow);
        the match then covers it. Caches without a second tier have none."""
        return match

    @abstractmethod
    def lock(self, node: object) -> None:
        """Protect the path root..node from eviction (ref count +1)."""

    @abstractmethod
    def unlock(self, node: object) -> None:
        """Undo one ``lock``; AssertionError if a ref count would go below zero."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int:
        """Insert the page-aligned prefix; return how many leading tokens were already cached.

        The caller frees its own pages for tokens [its previous prefix, returned
        length) (duplicates) and for tokens past the page-aligned length.
        """

    @abstractmethod
    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` unreferenced pages if possible; return pages freed."""

    @property
    @abstractmethod
    def evictable_pages(self) -> int:
        """Pages in the cache that no request references."""

    @property
    @abstractmethod
    def protected_pages(self) -> int:
        """Pages in the cache on some locked path."""

    @abstractmethod
    def check_integrity(self, in_use_pages: Iterable[int] = ()) -> None:
        """Recompute all invariants from scratch; AssertionError on the first violation."""

    @abstractmethod
    def reset(self) -> None:
        """Drop every cached entry (pages back to the allocator); nothing may be locked."""

    @property
    @abstractmethod
    def stats(self) -> CacheStats:
        """Snapshot of the hit-rate counters."""
