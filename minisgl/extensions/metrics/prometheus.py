"""Prometheus metrics: a server observer (minisgl/server/observers.py) that counts what the
server reports and serves GET /metrics. The metric families are tables (families.py), plus
what extensions describe of their own counters (minisgl/server/reports.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from minisgl.extensions.metrics.families import (
    FROM_STATS,
    LATENCIES,
    SCHEDULER_AND_COUNTS,
    Family,
    StatFn,
)
from minisgl.server.observers import AbortReason, RejectReason
from minisgl.server.reports import Counters, ExtensionMetric, extension_metrics
from minisgl.server.state import server_state

if TYPE_CHECKING:
    from minisgl.ipc.messages import TextOutput
    from minisgl.server.request_group import RequestGroup

M = TypeVar("M", Counter, Gauge, Histogram)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    def __init__(self, extra: Sequence[ExtensionMetric] | None = None) -> None:
        """``extra``: the extensions' metrics (default: every registered one)."""
        # The *_created timestamp series only add noise for a single-process server.
        disable_created_metrics()
        # A registry per server (not the global one), so several servers can live in one process.
        self.registry = CollectorRegistry()
        extra = extension_metrics() if extra is None else extra
        added = tuple(Family(m.name, m.help, m.kind, buckets=m.buckets) for m in extra)
        families = SCHEDULER_AND_COUNTS + added + LATENCIES
        self.metrics = {f.name: f.make(self.registry) for f in families}
        self.from_stats: list[tuple[str, tuple[str, ...], StatFn]] = [*FROM_STATS]
        self.from_stats += [(m.name, (), m.from_stats) for m in extra if m.from_stats]
        self.from_request = [
            (self._get(m.name, Histogram), m.from_request) for m in extra if m.from_request
        ]
        # Scheduler-side totals arrive as absolute numbers; counters only go up, so they are
        # advanced by the difference from what was seen at the previous scrape.
        self._seen: dict[tuple[str, tuple[str, ...]], float] = {}
        # Those updated for every output, looked up once.
        self.generation_tokens = self._get("minisgl_generation_tokens", Counter)
        self.ttft = self._get("minisgl_time_to_first_token_seconds", Histogram)
        self.queue_time = self._get("minisgl_queue_time_seconds", Histogram)
        self.itl = self._get("minisgl_inter_token_latency_seconds", Histogram)

    def _get(self, name: str, kind: type[M]) -> M:
        metric = self.metrics[name]
        assert isinstance(metric, kind), (name, kind)
        return metric

    # ------------------------------------------------------------ observer
    def on_output(self, group: RequestGroup, out: TextOutput, now: float) -> None:
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
            self._finished(out, now - group.arrival)

    def _finished(self, out: TextOutput, latency: float) -> None:
        self._get("minisgl_requests", Counter).labels(out.finish_reason or "abort").inc()
        self._get("minisgl_prompt_tokens", Counter).inc(out.prompt_tokens)
        self._get("minisgl_cached_prompt_tokens", Counter).inc(out.cached_tokens)
        self._get("minisgl_e2e_request_latency_seconds", Histogram).observe(latency)
        counters: Counters = out.counters
        for histogram, value_of in self.from_request:
            value = value_of(counters)
            if value is not None:
                histogram.observe(value)

    def on_rejected(self, reason: RejectReason) -> None:
        self._get("minisgl_rejected_requests", Counter).labels(reason).inc()

    def on_aborted(self, reason: AbortReason, n: int) -> None:
        if reason == "client_gone":
            self._get("minisgl_client_aborts", Counter).inc(n)
        else:
            self._get("minisgl_server_aborts", Counter).labels(reason).inc(n)

    def on_stats(self, stats: Mapping[str, object]) -> None:
        for name, labels, value_of in self.from_stats:
            value = value_of(stats)
            if value is None:
                continue
            metric = self.metrics[name]
            target = metric.labels(*labels) if labels else metric
            if isinstance(target, Gauge):
                target.set(value)
            elif isinstance(target, Counter):
                seen = self._seen.get((name, labels), 0.0)
                if value > seen:
                    target.inc(value - seen)
                    self._seen[name, labels] = value

    def mount(self, app: FastAPI) -> None:
        app.add_api_route("/metrics", self.serve, methods=["GET"])

    # ------------------------------------------------------------ exposition
    async def serve(self, request: Request) -> Response:
        await server_state(request).refresh_stats()
        return Response(self.render(), media_type=CONTENT_TYPE)

    def render(self) -> bytes:
        return generate_latest(self.registry)
