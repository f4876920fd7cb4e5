"""Server events for whoever watches them (the metrics extension's Prometheus counters): the
frontend, the guards, graceful shutdown and /abort_request report here instead of touching
any counter. With no observer registered every call does nothing."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from fastapi import FastAPI

    from minisgl.ipc.messages import TextOutput
    from minisgl.server.request_group import RequestGroup

# Why requests were refused before queueing (queue_full is counted by the scheduler).
RejectReason = Literal["unauthorized", "body_too_large", "shutting_down"]
# Why unfinished sequences were aborted: the client left, or the server ended them.
AbortReason = Literal["client_gone", "timeout", "shutdown", "abort_request"]


class ServerObserver(Protocol):
    def on_output(self, group: RequestGroup, out: TextOutput, now: float) -> None:
        """An output of one of the group's sequences reached the server (``now``:
        perf_counter seconds). Health probes are not reported."""
        ...

    def on_rejected(self, reason: RejectReason) -> None: ...

    def on_aborted(self, reason: AbortReason, n: int) -> None:
        """``n`` unfinished sequences were aborted."""
        ...

    def on_stats(self, stats: Mapping[str, object]) -> None:
        """The scheduler's stats, as the server fetched them (`ServerState.refresh_stats`)."""
        ...

    def mount(self, app: FastAPI) -> None:
        """Add the observer's routes, if any (e.g. /metrics)."""
        ...


class Observers:
    """Every observer of one server, called in turn."""

    def __init__(self, members: list[ServerObserver] | None = None) -> None:
        self.members = members or []

    def on_output(self, group: RequestGroup, out: TextOutput, now: float) -> None:
        for m in self.members:
            m.on_output(group, out, now)

    def on_rejected(self, reason: RejectReason) -> None:
        for m in self.members:
            m.on_rejected(reason)

    def on_aborted(self, reason: AbortReason, n: int) -> None:
        for m in self.members:
            m.on_aborted(reason, n)

    def on_stats(self, stats: Mapping[str, object]) -> None:
        for m in self.members:
            m.on_stats(stats)

    def mount(self, app: FastAPI) -> None:
        for m in self.members:
            m.mount(app)


# One observer per server (an observer may hold per-server state, e.g. a metrics registry).
_factories: list[Callable[[], ServerObserver]] = []


def register_observer(factory: Callable[[], ServerObserver]) -> None:
    _factories.append(factory)


def make_observers() -> Observers:
    """A new observer from every registered factory, the extensions loaded first."""
    from minisgl.extension_loader import load_extensions

    load_extensions()
    return Observers([make() for make in _factories])
