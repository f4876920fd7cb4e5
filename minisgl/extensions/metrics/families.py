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


# In the order they are rendered; extensions' metrics go between these two groups.
SCHEDULER_AND_COUNTS = (
    Family("minisgl_num_running_reqs", "Requests being decoded", "gauge"),
    Family("minisgl_num_waiting_reqs", "Requests waiting for admission", "gauge"),
    Family(
        "minisgl_kv_cache_usage",
        "Share of KV pages held by requests (neither free nor evictable cache)",
        "gauge",
    ),
    Family("minisgl_kv_pages", "KV pages by state", "gauge", ("state",)),
    Family("minisgl_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache", "gauge"),
    Family("minisgl_prompt_tokens", "Prompt tokens processed", "counter"),
    Family("minisgl_cached_prompt_tokens", "Prompt tokens served from the prefix cache", "counter"),
    Family("minisgl_generation_tokens", "Tokens generated", "counter"),
    Family(
        "minisgl_requests", "Finished sequences by finish reason", "counter", ("finish_reason",)
    ),
    Family("minisgl_client_aborts", "Sequences aborted because the client went away", "counter"),
    # reason: unauthorized | body_too_large | queue_full | shutting_down
    Family(
        "minisgl_rejected_requests",
        "HTTP requests refused before queueing, by reason",
        "counter",
        ("reason",),
    ),
    # reason: timeout | shutdown | abort_request
    Family(
        "minisgl_server_aborts", "Sequences the server aborted, by reason", "counter", ("reason",)
    ),
    Family(
        "minisgl_scheduler_aborts",
        "Sequences aborted in the scheduler (client gone, timeout, shutdown, stop string "
        "seen by the detokenizer), by where they were",
        "counter",
        ("phase",),  # waiting | prefill | decode
    ),
    Family("minisgl_integrity_checks", "KV integrity checks run by the scheduler", "counter"),
    Family(
        "minisgl_integrity_violations",
        "KV integrity checks that failed (leaked or double-owned pages or rows)",
        "counter",
    ),
)
LATENCIES = (
    Family(
        "minisgl_time_to_first_token_seconds",
        "Time to first token",
        "histogram",
        buckets=LATENCY_BUCKETS,
    ),
    Family(
        "minisgl_queue_time_seconds",
        "Time a request waited in the scheduler's queue before its first prefill",
        "histogram",
        buckets=LATENCY_BUCKETS,
    ),
    Family(
        "minisgl_inter_token_latency_seconds",
        "Time between consecutive output tokens",
        "histogram",
        buckets=LATENCY_BUCKETS,
    ),
    Family(
        "minisgl_e2e_request_latency_seconds",
        "Request latency, arrival to last token",
        "histogram",
        buckets=E2E_BUCKETS,
    ),
)


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
