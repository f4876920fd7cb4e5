"""Client-side serving metrics, as SGLang's bench_serving defines them.

- TTFT: request sent -> first streamed chunk that carries output (queueing and prefill included).
- ITL: every gap between consecutive output chunks, pooled over all requests.
- TPOT: per request, (E2E - TTFT) / (output tokens - 1); requests of one token have none.
- E2E: request sent -> end of the stream.
Output token counts come from the server's usage report, never from counting chunks: a chunk
may carry several tokens, and a token may decode to no text at all.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What the client saw of one request; times are ``time.perf_counter()`` seconds."""

    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried output
    end: float = 0.0
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0  # from the server's usage
    output_tokens: int = 0
    cached_tokens: int = 0
    expected_output_tokens: int = 0  # what the dataset asked for (max_tokens)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [t[i + 1] - t[i] for i in range(len(t) - 1)]

    @property
    def tpot(self) -> float | None:
        ttft = self.ttft
        if ttft is None or self.output_tokens <= 1:
            return None
        return (self.latency - ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        ms = 1000.0
        return {
            "success": self.success,
            "error": self.error,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens,
            "ttft_ms": None if self.ttft is None else round(self.ttft * ms, 3),
            "tpot_ms": None if self.tpot is None else round(self.tpot * ms, 3),
            "e2e_ms": round(self.latency * ms, 3),
            "itl_ms": [round(x * ms, 3) for x in self.itl],
        }


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between order statistics (numpy's
    default method), so figures match bench_serving's ``np.percentile``."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def describe(values: Iterable[float], scale: float = 1000.0) -> dict[str, float]:
    """Mean, p50/p90/p99, min/max and the count, scaled (seconds -> ms by default)."""
    xs = [v * scale for v in values]
    out: dict[str, float] = {"count": len(xs)}
    if not xs:
        return {**out, "mean": math.nan, **{f"p{p}": math.nan for p in PERCENTILES}}
    out["mean"] = sum(xs) / len(xs)
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(xs, p)
    out["min"], out["max"] = min(xs), max(xs)
    return out


def summarize(records: Sequence[RequestRecord], duration: float) -> dict[str, Any]:
    """Aggregate figures of one run; latencies only over successful requests, throughputs
    over the whole wall time of the run (first send to last response)."""
    ok = [r for r in records if r.success]
    duration = max(duration, 1e-9)
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    e2e = [r.latency for r in ok]
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "total_cached_tokens": sum(r.cached_tokens for r in ok),
        "expected_output_tokens": sum(r.expected_output_tokens for r in ok),
        "request_throughput": len(ok) / duration,
        "input_throughput": input_tokens / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        # Little's law: the mean number of requests in flight over the run.
        "concurrency": sum(e2e) / duration,
        "ttft_ms": describe(r.ttft for r in ok if r.ttft is not None),
        "tpot_ms": describe(t for r in ok if (t := r.tpot) is not None),
        "itl_ms": describe(gap for r in ok for gap in r.itl),
        "e2e_ms": describe(e2e),
    }


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"{'successful requests':<28}{s['completed']:>12}",
        f"{'failed requests':<28}{s['failed']:>12}",
        f"{'duration (s)':<28}{s['duration_s']:>12.2f}",
        f"{'input tokens':<28}{s['total_input_tokens']:>12}",
        f"{'output tokens':<28}{s['total_output_tokens']:>12}",
        f"{'cached prompt tokens':<28}{s['total_cached_tokens']:>12}",
        f"{'request throughput (req/s)':<28}{s['request_throughput']:>12.2f}",
        f"{'output throughput (tok/s)':<28}{s['output_throughput']:>12.1f}",
        f"{'total throughput (tok/s)':<28}{s['total_token_throughput']:>12.1f}",
        f"{'concurrency':<28}{s['concurrency']:>12.2f}",
        f"{'(ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for key, name in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2e_ms", "E2E"),
    ):
        d = s[key]
        lines.append(
            f"{name:<12}{d['mean']:>10.1f}{d['p50']:>10.1f}{d['p90']:>10.1f}{d['p99']:>10.1f}"
        )
    return "\n".join(lines)
