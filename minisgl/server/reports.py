"""How extensions report the per-request counters they keep (`TextOutput.counters`, e.g.
speculation's verify steps), without the core server knowing them:

- a usage reporter turns the counters of a request's choices into extra fields of the
  OpenAI ``usage`` object and of /generate's ``meta_info``;
- an `ExtensionMetric` describes a Prometheus metric derived from them (or from the
  scheduler's stats), which the metrics extension renders.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from minisgl.ipc.messages import JSONDict

T = TypeVar("T")
Counters = Mapping[str, int]


@dataclass(frozen=True)
class UsageReport:
    usage: JSONDict = field(default_factory=dict)  # merged into OpenAI's usage
    meta_info: JSONDict = field(default_factory=dict)  # merged into /generate's meta_info


# Gets the counters of every choice of a request (one for a /generate item); returns what
# it adds, or None when it has nothing to say (e.g. the request did not speculate).
UsageReporter = Callable[[Sequence[Counters]], UsageReport | None]
_reporters: list[UsageReporter] = []


def register_usage_reporter(reporter: UsageReporter) -> None:
    _reporters.append(reporter)


def usage_reports(choices: Sequence[Counters]) -> list[UsageReport]:
    """What every registered reporter adds for a request with these choices."""
    reports = (reporter(choices) for reporter in _loaded(_reporters))
    return [r for r in reports if r is not None]


@dataclass(frozen=True)
class ExtensionMetric:
    """A metric an extension contributes. ``from_stats`` reads the scheduler's stats (each
    /metrics scrape): a counter's running total, or a gauge's value; None leaves the metric
    as it is. ``from_request`` reads a finished request's counters: one observation of a
    histogram, or None for none."""

    name: str
    help: str
    kind: Literal["counter", "gauge", "histogram"]
    from_stats: Callable[[Mapping[str, object]], float | None] | None = None
    from_request: Callable[[Counters], float | None] | None = None
    buckets: tuple[float, ...] = ()


_metrics: list[ExtensionMetric] = []


def register_metric(metric: ExtensionMetric) -> None:
    _metrics.append(metric)


def extension_metrics() -> list[ExtensionMetric]:
    return _loaded(_metrics)


def _loaded(items: list[T]) -> list[T]:
    from minisgl.extension_loader import load_extensions

    load_extensions()
    return list(items)
