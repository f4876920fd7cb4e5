"""The server's own view of a run, from its Prometheus ``/metrics``, beside the client's.

Counters and histograms are cumulative over the server's life, so a run is measured as the
difference of two scrapes (before and after). Metric names are matched without their
namespace (``minisgl_``, ``sglang:``, ``vllm:``), so SGLang and vLLM servers report too.
"""

from __future__ import annotations

import math
import re
from typing import Any

import aiohttp

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)")

# Base names (namespace stripped) per quantity, in order of preference.
NAMES: dict[str, tuple[str, ...]] = {
    "ttft": ("time_to_first_token_seconds",),
    "itl": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
    "e2e": ("e2e_request_latency_seconds",),
    "output_tokens": ("generation_tokens_total",),
    "prompt_tokens": ("prompt_tokens_total",),
    "cached_tokens": ("cached_prompt_tokens_total", "cached_tokens_total"),
    "requests": ("requests_total", "num_requests_total", "request_success_total"),
}


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample values by metric name, summed over label sets (e.g. every finish reason)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or line.startswith("#"):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if m.group(1).endswith("_bucket") or math.isnan(value):
            continue  # buckets are summed per `le`, meaningless across them
        out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


def _base(name: str) -> str:
    if ":" in name:
        return name.split(":", 1)[1]
    return name.split("_", 1)[1] if "_" in name else name


def _by_base(samples: dict[str, float]) -> dict[str, float]:
    return {_base(k): v for k, v in samples.items()}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def server_view(diff: dict[str, float]) -> dict[str, float | None]:
    """Means (ms) of the server's latency histograms and its token/request counters."""
    base = _by_base(diff)
    out: dict[str, float | None] = {}
    for key in ("ttft", "itl", "e2e"):
        out[f"{key}_mean_ms"] = None
        for name in NAMES[key]:
            count = base.get(f"{name}_count")
            if count:
                out[f"{key}_mean_ms"] = 1000.0 * base.get(f"{name}_sum", 0.0) / count
                out[f"{key}_count"] = count
                break
    for key in ("output_tokens", "prompt_tokens", "cached_tokens", "requests"):
        out[key] = next((base[n] for n in NAMES[key] if n in base), None)
    return out


def client_view(summary: dict[str, Any]) -> dict[str, float | None]:
    return {
        "ttft_mean_ms": summary["ttft_ms"]["mean"],
        "itl_mean_ms": summary["itl_ms"]["mean"],
        "e2e_mean_ms": summary["e2e_ms"]["mean"],
        "output_tokens": summary["total_output_tokens"],
        "prompt_tokens": summary["total_input_tokens"],
        "cached_tokens": summary["total_cached_tokens"],
        "requests": summary["completed"],
    }


def format_comparison(client: dict[str, Any], server: dict[str, Any]) -> str:
    rows = [f"{'':<22}{'client':>14}{'server /metrics':>18}"]
    for key in ("ttft_mean_ms", "itl_mean_ms", "e2e_mean_ms"):
        rows.append(f"{key:<22}{_fmt(client.get(key)):>14}{_fmt(server.get(key)):>18}")
    for key in ("output_tokens", "prompt_tokens", "cached_tokens", "requests"):
        rows.append(f"{key:<22}{_fmt(client.get(key), 0):>14}{_fmt(server.get(key), 0):>18}")
    return "\n".join(rows)


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


async def scrape(session: aiohttp.ClientSession, base_url: str) -> dict[str, float] | None:
    """Parsed /metrics, or None when the server has none."""
    try:
        async with session.get(base_url.rstrip("/") + "/metrics") as resp:
            if resp.status != 200:
                return None
            return parse_prometheus(await resp.text())
    except aiohttp.ClientError:
        return None
