"""HiCache: a second tier of KV cache in host memory. Prefixes the device pool evicts are
saved to host pages (write-back; or when first cached, write-through) and copied back on a
hit instead of being recomputed.

The core keeps the tree (minisgl/kvcache/tiered_cache.py: which node is on the device, on
the host, or both) behind the `CacheTier` interface (minisgl/kvcache/tier.py); this
package is the tier: the host pool and its copies (host_tier.py), registered with
``register_tier``, its ``--hicache-*`` options, and its reports. Importing it stays light
(no torch): the API server loads it for its options."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minisgl.config import EngineConfig, OptionGroup, register_options
from minisgl.extensions.hicache import report
from minisgl.extensions.hicache.options import HiCacheOptions, check
from minisgl.kvcache.tier import register_tier
from minisgl.scheduler.plugins import register_counter_report

if TYPE_CHECKING:
    from minisgl.kvcache.pool import KVPool
    from minisgl.kvcache.tier import CacheTier


def make_tier(config: EngineConfig, pool: KVPool) -> CacheTier | None:
    o = config.ext(HiCacheOptions)
    if o.hicache_size <= 0:
        return None
    from minisgl.extensions.hicache.host_tier import HostTier, host_pages

    # Each TP rank holds its shard of every page (its KV heads): the same number of pages.
    pages = host_pages(o.hicache_size / config.tp_size, pool)
    return HostTier(pool, pages, write_through=o.hicache_write_policy == "write_through")


register_options(OptionGroup("HiCache (host KV-cache tier)", HiCacheOptions, check))
register_tier(make_tier)
register_counter_report(report.counter_report)
report.register()
