"""Prometheus metrics for the API server: GET /metrics (prometheus.py)."""

from __future__ import annotations

from minisgl.server.observers import ServerObserver, register_observer


def _server_metrics() -> ServerObserver:
    # Imported when a server starts, not wherever extensions are loaded (e.g. the engine's
    # child processes, which have no use for prometheus_client and FastAPI).
    from minisgl.extensions.metrics.prometheus import ServerMetrics

    return ServerMetrics()


register_observer(_server_metrics)
