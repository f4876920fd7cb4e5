"""Speculation as the server reports it, from each request's counters (running totals the
scheduler keeps: verify steps, draft tokens verified, drafts accepted) and the scheduler's
stats of the same names.

- OpenAI usage: OpenAI's predicted-output fields (completion_tokens_details: drafts kept and
  rejected) and the four spec_* figures; /generate's meta_info: the spec_* figures.
- /metrics: the three totals, the mean accept length since start, and a histogram of it per
  finished request.

Nothing is reported for a request that never verified drafts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from minisgl.extensions.speculative.report import (
    ACCEPTED,
    DRAFTED,
    VERIFY_STEPS,
    accept_length,
    spec_report,
)
from minisgl.server.reports import (
    Counters,
    ExtensionMetric,
    UsageReport,
    register_metric,
    register_usage_reporter,
)

STEPS = VERIFY_STEPS
# Tokens per verify step: 1 (every draft rejected) to speculative_num_steps + 1 (max 17).
ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0, 17.0)


def usage_report(choices: Sequence[Counters]) -> UsageReport | None:
    steps = sum(c.get(STEPS, 0) for c in choices)
    if not steps:
        return None
    drafted = sum(c.get(DRAFTED, 0) for c in choices)
    accepted = sum(c.get(ACCEPTED, 0) for c in choices)
    figures = spec_report(steps, drafted, accepted)
    details = {
        "accepted_prediction_tokens": accepted,
        "rejected_prediction_tokens": drafted - accepted,
    }
    return UsageReport(usage={"completion_tokens_details": details, **figures}, meta_info=figures)


def _stat(stats: Mapping[str, object], name: str) -> float:
    value = stats.get(name, 0)
    return float(value) if isinstance(value, (int, float)) else 0.0


def _total(name: str) -> ExtensionMetric:
    helps = {
        STEPS: "Speculative verify steps (one per request per step that verified drafts)",
        DRAFTED: "Draft tokens verified by the target",
        ACCEPTED: "Draft tokens the target accepted",
    }
    return ExtensionMetric(
        f"minisgl_{name}", helps[name], "counter", from_stats=lambda s: _stat(s, name)
    )


METRICS = [
    _total(STEPS),
    _total(DRAFTED),
    _total(ACCEPTED),
    ExtensionMetric(
        "minisgl_spec_accept_length",
        "Mean tokens emitted per verify step since start (accepted drafts + 1)",
        "gauge",
        from_stats=lambda s: accept_length(_stat(s, STEPS), _stat(s, ACCEPTED)),
    ),
    ExtensionMetric(
        "minisgl_spec_request_accept_length",
        "Per finished request that speculated: tokens emitted per verify step",
        "histogram",
        from_request=lambda c: accept_length(c.get(STEPS, 0), c.get(ACCEPTED, 0)),
        buckets=ACCEPT_BUCKETS,
    ),
]


def register() -> None:
    register_usage_reporter(usage_report)
    for metric in METRICS:
        register_metric(metric)
