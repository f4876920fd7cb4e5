"""The server's Prometheus metrics as tables: every family (name, help, kind, labels), and
which of them are read from the scheduler's stats at each scrape. Latencies are measured in
the API server (what a client sees); queue and KV gauges come from the scheduler."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

Kind = Literal["counter", "gauge", "histogram"]
Metric = Counter | Gauge | Histogram
Stats = Mapping[str, object]
# A value read from the scheduler's stats: a gauge's value or a counter's running total
# (None: leave the metric as it is).
StatFn = Callable[[Stats], "float | None"]

_SUB_SECOND = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75)
LATENCY_BUCKETS = _SUB_SECOND + (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
ABORT_PHASES = ("waiting", "prefill", "decode")


@dataclass(frozen=True)
class Family:
    name: str
    help: str
    kind: Kind
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    def make(self, registry: CollectorRegistry) -> Metric:
        if self.kind == "histogram":
            return Histogram(
                self.name, self.help, self.labels, buckets=self.buckets, registry=registry
            )
        kind = Counter if self.kind == "counter" else Gauge
        return kind(self.name, self.help, self.labels, registry=registry)


# name: help, in the order they are rendered (extensions' metrics go before the latencies).
_GAUGES = {
    "minisgl_num_running_reqs": "Requests being decoded",
    "minisgl_num_waiting_reqs": "Requests waiting for admission",
    "minisgl_kv_cache_usage": "Share of KV pages held by requests (neither free nor evictable "
    "cache)",
    "minisgl_kv_pages": "KV pages by state",
    "minisgl_prefix_cache_hit_rate": "Prompt tokens served from the prefix cache",
}
_COUNTERS = {
    "minisgl_prompt_tokens": "Prompt tokens processed",
    "minisgl_cached_prompt_tokens": "Prompt tokens served from the prefix cache",
    "minisgl_generation_tokens": "Tokens generated",
    "minisgl_requests": "Finished sequences by finish reason",
    "minisgl_client_aborts": "Sequences aborted because the client went away",
    "minisgl_rejected_requests": "HTTP requests refused before queueing, by reason",
    "minisgl_server_aborts": "Sequences the server aborted, by reason",
    "minisgl_scheduler_aborts": "Sequences aborted in the scheduler (client gone, timeout, "
    "shutdown, stop string seen by the detokenizer), by where they were",
    "minisgl_integrity_checks": "KV integrity checks run by the scheduler",
    "minisgl_integrity_violations": "KV integrity checks that failed (leaked or double-owned "
    "pages or rows)",
}
_HISTOGRAMS = {
    "minisgl_time_to_first_token_seconds": "Time to first token",
    "minisgl_queue_time_seconds": "Time a request waited in the scheduler's queue before its "
    "first prefill",
    "minisgl_inter_token_latency_seconds": "Time between consecutive output tokens",
    "minisgl_e2e_request_latency_seconds": "Request latency, arrival to last token",
}
_LABELS = {
    "minisgl_kv_pages": ("state",),  # free | evictable | total
    "minisgl_requests": ("finish_reason",),
    # unauthorized | body_too_large | queue_full | shutting_down
    "minisgl_rejected_requests": ("reason",),
    "minisgl_server_aborts": ("reason",),  # timeout | shutdown | abort_request
    "minisgl_scheduler_aborts": ("phase",),  # waiting | prefill | decode
}
_BUCKETS = {"minisgl_e2e_request_latency_seconds": E2E_BUCKETS}  # others: LATENCY_BUCKETS


def _family(name: str, help: str, kind: Kind) -> Family:
    buckets = _BUCKETS.get(name, LATENCY_BUCKETS) if kind == "histogram" else ()
    return Family(name, help, kind, _LABELS.get(name, ()), buckets)


SCHEDULER_AND_COUNTS = tuple(_family(n, h, "gauge") for n, h in _GAUGES.items()) + tuple(
    _family(n, h, "counter") for n, h in _COUNTERS.items()
)
LATENCIES = tuple(_family(n, h, "histogram") for n, h in _HISTOGRAMS.items())


def stat(stats: Stats, key: str) -> float:
    value = stats.get(key, 0)
    return float(value) if isinstance(value, (int, float)) else 0.0


def _key(key: str) -> StatFn:
    return lambda stats: stat(stats, key)


def _total_pages(stats: Stats) -> float:
    return max(1.0, stat(stats, "total_pages"))


def _kv_usage(stats: Stats) -> float:
    total = _total_pages(stats)
    return (total - stat(stats, "free_pages") - stat(stats, "evictable_pages")) / total


# (family, label values, value): what each scrape reads from the scheduler's stats.
FROM_STATS: tuple[tuple[str, tuple[str, ...], StatFn], ...] = (
    ("minisgl_num_running_reqs", (), _key("running")),
    ("minisgl_num_waiting_reqs", (), _key("waiting")),
    ("minisgl_kv_cache_usage", (), _kv_usage),
    ("minisgl_kv_pages", ("free",), _key("free_pages")),
    ("minisgl_kv_pages", ("evictable",), _key("evictable_pages")),
    ("minisgl_kv_pages", ("total",), _total_pages),
    ("minisgl_prefix_cache_hit_rate", (), _key("prefix_hit_rate")),
    ("minisgl_integrity_checks", (), _key("integrity_checks")),
    ("minisgl_integrity_violations", (), _key("integrity_violations")),
    ("minisgl_rejected_requests", ("queue_full",), _key("rejected_queue_full")),
    *(("minisgl_scheduler_aborts", (p,), _key(f"aborts_{p}")) for p in ABORT_PHASES),
)
