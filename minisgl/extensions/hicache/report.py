"""HiCache as the server and `LLM` report it: ``host_cached_tokens`` per request (prompt
tokens whose KV came back from the host tier; they are part of ``cached_tokens``), and the
host tier's figures in the scheduler's stats, as metrics. No torch: the server imports it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from minisgl.config import EngineConfig
from minisgl.extensions.hicache.options import HiCacheOptions
from minisgl.kvcache.tier import HOST_CACHED_TOKENS
from minisgl.server.reports import (
    Counters,
    ExtensionMetric,
    UsageReport,
    register_metric,
    register_usage_reporter,
)

# The scheduler's stats the host tier keeps (HostTier.totals).
PAGES, PAGES_USED = "hicache_host_pages", "hicache_host_pages_used"
LOADED, SAVED = "hicache_loaded_tokens", "hicache_saved_tokens"
TO_DEVICE, TO_HOST = "hicache_bytes_to_device", "hicache_bytes_to_host"


def counter_report(config: EngineConfig, counters: dict[str, int]) -> dict[str, object]:
    """`LLM` results: the field, when HiCache is on."""
    if config.ext(HiCacheOptions).hicache_size <= 0:
        return {}
    return {HOST_CACHED_TOKENS: counters.get(HOST_CACHED_TOKENS, 0)}


def usage_report(choices: Sequence[Counters]) -> UsageReport | None:
    """The choices share one prompt: its host hit is the largest any choice saw."""
    hit = max((c.get(HOST_CACHED_TOKENS, 0) for c in choices), default=0)
    if not hit:
        return None
    fields = {HOST_CACHED_TOKENS: hit}
    return UsageReport(usage=dict(fields), meta_info=dict(fields))


def _stat(name: str) -> ExtensionMetric:
    helps: dict[str, tuple[str, Literal["counter", "gauge"]]] = {
        PAGES: ("HiCache host tier size in pages", "gauge"),
        PAGES_USED: ("HiCache host tier pages holding KV", "gauge"),
        LOADED: ("Tokens of KV loaded back from the host tier (host hits)", "counter"),
        SAVED: ("Tokens of KV saved to the host tier", "counter"),
        TO_DEVICE: ("Bytes copied from the host tier to the device", "counter"),
        TO_HOST: ("Bytes copied from the device to the host tier", "counter"),
    }
    text, kind = helps[name]

    def read(stats: Mapping[str, object]) -> float | None:
        value = stats.get(name)
        return float(value) if isinstance(value, (int, float)) else None

    return ExtensionMetric(f"minisgl_{name}", text, kind, from_stats=read)


def register() -> None:
    register_usage_reporter(usage_report)
    for name in (PAGES, PAGES_USED, LOADED, SAVED, TO_DEVICE, TO_HOST):
        register_metric(_stat(name))
