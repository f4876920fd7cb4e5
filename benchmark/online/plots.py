"""Plots of result files: latency CDFs of every run, and (for sweeps) throughput and latency
against request rate. Several result files overlay, so engines or cache modes can be compared:

    python benchmark/online/plots.py radix.json naive.json -o compare.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402

DPI = 72  # keeps the PNGs around 50-100 kB


def _cdf(ax: Any, values: list[float], label: str, scale: float = 1.0) -> None:
    xs = sorted(v / scale for v in values if v is not None)
    if xs:
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=label)


def _num(v: Any) -> float:
    """Result files store inf as "inf" and NaN as null (strict JSON has neither)."""
    return math.nan if v is None else float(v)


def _run_label(result: dict[str, Any], run: dict[str, Any], many: bool) -> str:
    parts = [result.get("label", "")] if many else []
    rate = _num(run["request_rate"])
    parts.append(f"{'inf' if math.isinf(rate) else f'{rate:g}'} req/s")
    if run.get("max_concurrency"):
        parts.append(f"conc {run['max_concurrency']}")
    return ", ".join(p for p in parts if p)


def _rate_x(rates: list[float]) -> list[float]:
    """Request rates as x positions; ``inf`` sits at twice the largest finite rate."""
    finite = [r for r in rates if not math.isinf(r)]
    top = 2 * max(finite) if finite else 1.0
    return [top if math.isinf(r) else r for r in rates]


def plot_results(results: list[dict[str, Any]], path: str | Path) -> Path:
    many = len(results) > 1
    sweep = any(len(r["runs"]) > 1 for r in results)
    rows = 2 if sweep else 1
    fig, axes = plt.subplots(rows, 3, figsize=(13, 4 * rows), squeeze=False)
    cdfs = (("ttft_ms", "TTFT"), ("itl_ms", "ITL, pooled"), ("e2e_ms", "E2E latency"))
    for ax, (key, title) in zip(axes[0], cdfs, strict=True):
        series = []
        for result in results:
            for run in result["runs"]:
                reqs = [q for q in run["requests"] if q["success"]]
                if key == "itl_ms":
                    values = [gap for q in reqs for gap in q["itl_ms"]]
                else:
                    values = [q[key] for q in reqs if q[key] is not None]
                series.append((values, _run_label(result, run, many)))
        # Seconds once latencies reach tens of seconds (overloaded CPU runs): ms tick labels
        # would run into each other.
        top = max((max(v) for v, _ in series if v), default=0.0)
        scale, unit = (1000.0, "s") if top > 10_000 else (1.0, "ms")
        for values, label in series:
            _cdf(ax, values, label, scale)
        ax.set_xlabel(f"{title} ({unit})")
        ax.set_ylabel("fraction of requests" if key != "itl_ms" else "fraction of gaps")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    if sweep:
        _plot_sweep(axes[1], results)
    fig.suptitle(_title(results), fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _plot_sweep(axes: Any, results: list[dict[str, Any]]) -> None:
    for result in results:
        runs = sorted(result["runs"], key=lambda r: _num(r["request_rate"]))
        rates = [_num(r["request_rate"]) for r in runs]
        x = _rate_x(rates)
        name = result.get("label") or "run"
        s = [r["summary"] for r in runs]
        axes[0].plot(x, [_num(v["output_throughput"]) for v in s], "o-", label=f"{name} output")
        axes[0].plot(
            x, [_num(v["request_throughput"]) * 10 for v in s], "s--", label=f"{name} req x10"
        )
        for ax, key in ((axes[1], "ttft_ms"), (axes[2], "tpot_ms")):
            ax.plot(x, [_num(v[key]["mean"]) for v in s], "o-", label=f"{name} mean")
            ax.plot(x, [_num(v[key]["p99"]) for v in s], "^--", label=f"{name} p99")
        for ax in axes:
            ax.set_xticks(x, ["inf" if math.isinf(r) else f"{r:g}" for r in rates])
    ylabels = ("throughput (tok/s; req/s x10)", "TTFT (ms)", "TPOT (ms)")
    for ax, ylabel in zip(axes, ylabels, strict=True):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def _title(results: list[dict[str, Any]]) -> str:
    cfg = results[0].get("config", {})
    labels = ", ".join(r.get("label", "?") for r in results)
    return (
        f"{labels} | {cfg.get('dataset', '')} via {cfg.get('backend', '')} | {cfg.get('model', '')}"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("results", nargs="+", help="result JSON files of bench_serving.py")
    ap.add_argument("-o", "--output", required=True, help="PNG to write")
    args = ap.parse_args(argv)
    results = [json.loads(Path(p).read_text()) for p in args.results]
    print(plot_results(results, args.output))


if __name__ == "__main__":
    sys.exit(main())
