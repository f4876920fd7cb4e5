"""A second tier of KV pages below the device pool, and where one is registered.

The tiered radix cache (tiered_cache.py) keeps the tree: which node's KV is on the device,
in the tier, or in both. A `CacheTier` only holds pages and moves them. The cache calls it
on eviction (``save``: a node leaving the device keeps its KV in the tier; under
write-through, ``save`` also runs when a node is first cached), on a match that reaches into
the tier (``load``: pages come back to freshly allocated device pages), and on flush
(``free`` of every tier page). The host tier (HiCache) is an extension
(minisgl/extensions/hicache) registering a factory here; with no factory, or one that
returns None, the plain radix cache runs, unchanged.

Light: the extension registers without loading torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from minisgl.config import EngineConfig

if TYPE_CHECKING:
    import torch

    from minisgl.kvcache.pool import KVPool

# Req.counters: prompt tokens whose KV came back from the tier at admission (a subset of
# the request's cached_tokens).
HOST_CACHED_TOKENS = "host_cached_tokens"


class CacheTier(Protocol):
    write_through: bool  # save a node when it is first cached, not when it is evicted
    num_pages: int  # pages of the tier (the device pool's page size)
    totals: dict[str, int]  # the scheduler's run totals, where the tier adds its figures

    @property
    def num_free_pages(self) -> int: ...

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` tier page ids (int64, CPU), or None (allocating nothing) if short."""

    def free(self, pages: torch.Tensor) -> None:
        """Give tier pages back; AssertionError on a double free."""

    def free_pages_set(self) -> set[int]:
        """The free tier pages (for integrity checks)."""

    def save(self, device_pages: torch.Tensor, tier_pages: torch.Tensor) -> None:
        """Copy the KV of device pages into tier pages (page i to page i), every layer."""

    def load(self, tier_pages: torch.Tensor, device_pages: torch.Tensor) -> None:
        """Copy tier pages back to device pages. It may return before the copy is done
        if attention waits for each layer's (`KVPool.wait_layer`)."""


TierFactory = Callable[[EngineConfig, "KVPool"], "CacheTier | None"]
_factories: list[TierFactory] = []


def register_tier(factory: TierFactory) -> None:
    _factories.append(factory)


def make_tier(config: EngineConfig, pool: KVPool) -> CacheTier | None:
    """The first tier a registered factory builds for this configuration (None: no tier)."""
    from minisgl.extension_loader import load_extensions

    load_extensions()
    for factory in _factories:
        tier = factory(config, pool)
        if tier is not None:
            return tier
    return None
