"""Prometheus metrics. Latencies are measured in the API server (what a client sees); queue and
KV gauges are refreshed from the scheduler when /metrics is scraped."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

if TYPE_CHECKING:
    from minisgl.ipc.messages import TextOutput
    from minisgl.server.frontend import RequestGroup

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
# Tokens per verify step: 1 (every draft rejected) to speculative_num_steps + 1 (max 17).
_ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0, 17.0)


class ServerMetrics:
    def __init__(self) -> None:
        # The *_created timestamp series only add noise for a single-process server.
        disable_created_metrics()
        # A registry per server (not the global one), so several servers can live in one process.
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("minisgl_num_running_reqs", "Requests being decoded", registry=r)
        self.waiting = Gauge(
            "minisgl_num_waiting_reqs", "Requests waiting for admission", registry=r
        )
        self.kv_usage = Gauge(
            "minisgl_kv_cache_usage",
            "Share of KV pages held by requests (neither free nor evictable cache)",
            registry=r,
        )
        self.kv_pages = Gauge("minisgl_kv_pages", "KV pages by state", ["state"], registry=r)
        self.hit_rate = Gauge(
            "minisgl_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache",
            registry=r,
        )
        self.prompt_tokens = Counter("minisgl_prompt_tokens", "Prompt tokens processed", registry=r)
        self.cached_tokens = Counter(
            "minisgl_cached_prompt_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.generation_tokens = Counter(
            "minisgl_generation_tokens", "Tokens generated", registry=r
        )
        self.requests = Counter(
            "minisgl_requests", "Finished sequences by finish reason", ["finish_reason"], registry=r
        )
        self.aborted_requests = Counter(
            "minisgl_client_aborts", "Sequences aborted because the client went away", registry=r
        )
        self.rejected = Counter(
            "minisgl_rejected_requests",
            "HTTP requests refused before queueing, by reason",
            ["reason"],  # unauthorized | body_too_large | queue_full | shutting_down
            registry=r,
        )
        self.server_aborts = Counter(
            "minisgl_server_aborts",
            "Sequences the server aborted, by reason",
            ["reason"],  # timeout | shutdown | abort_request
            registry=r,
        )
        self.scheduler_aborts = Counter(
            "minisgl_scheduler_aborts",
            "Sequences aborted in the scheduler (client gone, timeout, shutdown, stop string "
            "seen by the detokenizer), by where they were",
            ["phase"],  # waiting | prefill | decode
            registry=r,
        )
        self.integrity_checks = Counter(
            "minisgl_integrity_checks", "KV integrity checks run by the scheduler", registry=r
        )
        self.integrity_violations = Counter(
            "minisgl_integrity_violations",
            "KV integrity checks that failed (leaked or double-owned pages or rows)",
            registry=r,
        )
        self.spec_verify_steps = Counter(
            "minisgl_spec_verify_steps",
            "Speculative verify steps (one per request per step that verified drafts)",
            registry=r,
        )
        self.spec_draft_tokens = Counter(
            "minisgl_spec_draft_tokens", "Draft tokens verified by the target", registry=r
        )
        self.spec_accepted_tokens = Counter(
            "minisgl_spec_accepted_tokens", "Draft tokens the target accepted", registry=r
        )
        self.spec_accept_length = Gauge(
            "minisgl_spec_accept_length",
            "Mean tokens emitted per verify step since start (accepted drafts + 1)",
            registry=r,
        )
        self.spec_request_accept_length = Histogram(
            "minisgl_spec_request_accept_length",
            "Per finished request that speculated: tokens emitted per verify step",
            buckets=_ACCEPT_BUCKETS,
            registry=r,
        )
        # Scheduler-side totals arrive as absolute numbers; counters only go up, so they are
        # advanced by the difference from what was seen at the previous scrape.
        self._seen: dict[str, int] = {}
        self.ttft = Histogram(
            "minisgl_time_to_first_token_seconds", "Time to first token",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_time = Histogram(
            "minisgl_queue_time_seconds",
            "Time a request waited in the scheduler's queue before its first prefill",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "minisgl_inter_token_latency_seconds", "Time between consecutive output tokens",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "minisgl_e2e_request_latency_seconds", "Request latency, arrival to last token",
            buckets=_E2E_BUCKETS, registry=r,
        )  # fmt: skip

    def observe_output(self, group: RequestGroup, out: TextOutput, now: float) -> None:
        n = len(out.token_ids)
        if n:
            self.generation_tokens.inc(n)
            last = group.last_token_at.get(out.rid)
            if last is None:
                self.ttft.observe(now - group.arrival)
                self.queue_time.observe(out.queue_time)
                n -= 1  # the first token has a TTFT, not an inter-token gap
            else:
                # Several tokens in one output share the gap evenly (as SGLang reports ITL).
                for _ in range(n):
                    self.itl.observe((now - last) / n)
            group.last_token_at[out.rid] = now
        if out.finished:
            self.requests.labels(out.finish_reason or "abort").inc()
            self.prompt_tokens.inc(out.prompt_tokens)
            self.cached_tokens.inc(out.cached_tokens)
            self.e2e.observe(now - group.arrival)
            if out.spec_verify_steps:
                steps = out.spec_verify_steps
                self.spec_request_accept_length.observe(1 + out.spec_accepted_tokens / steps)

    def refresh(self, stats: dict[str, Any]) -> None:
        total = max(1, int(stats["total_pages"]))
        free, evictable = int(stats["free_pages"]), int(stats["evictable_pages"])
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.kv_usage.set((total - free - evictable) / total)
        self.kv_pages.labels("free").set(free)
        self.kv_pages.labels("evictable").set(evictable)
        self.kv_pages.labels("total").set(total)
        self.hit_rate.set(stats["prefix_hit_rate"])
        self._advance(self.integrity_checks, "integrity_checks", stats)
        self._advance(self.integrity_violations, "integrity_violations", stats)
        self._advance(self.rejected.labels("queue_full"), "rejected_queue_full", stats)
        for phase in ("waiting", "prefill", "decode"):
            self._advance(self.scheduler_aborts.labels(phase), f"aborts_{phase}", stats)
        self._advance(self.spec_verify_steps, "spec_verify_steps", stats)
        self._advance(self.spec_draft_tokens, "spec_draft_tokens", stats)
        self._advance(self.spec_accepted_tokens, "spec_accepted_tokens", stats)
        steps = int(stats.get("spec_verify_steps", 0))
        if steps:
            self.spec_accept_length.set(1 + int(stats["spec_accepted_tokens"]) / steps)

    def _advance(self, counter: Any, key: str, stats: dict[str, Any]) -> None:
        total = int(stats.get(key, 0))
        delta = total - self._seen.get(key, 0)
        if delta > 0:
            counter.inc(delta)
            self._seen[key] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)
