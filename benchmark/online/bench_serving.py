"""Online serving benchmark against a running server (minisgl, SGLang, vLLM, any OpenAI API).

    python -m minisgl --port 1919 &
    python benchmark/online/bench_serving.py --num-prompts 40 --sweep-rates 1,2,4 --flush-cache
    python benchmark/online/bench_serving.py --dataset shared-prefix --gsp-num-groups 4 \\
        --gsp-prompts-per-group 8 --gsp-system-prompt-len 512 --gsp-question-len 32
    python benchmark/online/bench_serving.py --dataset trace --trace-file mooncake.jsonl \\
        --trace-time-scale 0.5 --base-url http://127.0.0.1:30000 --label sglang

Metrics follow SGLang's bench_serving (TTFT, pooled ITL, TPOT, E2E; output token counts from
the server's usage). Writes a JSON result (``--output``) and a PNG beside it; when the server
has /metrics, prints its TTFT/ITL/E2E means and token counters beside the client's.
Overlay several result files with ``benchmark/online/plots.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmark.online import datasets, runner, server_metrics  # noqa: E402
from benchmark.online.backends import BACKENDS, Endpoint, served_model  # noqa: E402
from benchmark.online.metrics import format_summary  # noqa: E402

RESULTS_DIR = REPO / "benchmark" / "online" / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    a = ap.add_argument
    a("--base-url", default="http://127.0.0.1:1919")
    a(
        "--backend",
        choices=BACKENDS,
        default="completions",
        help="API to call (default %(default)s)",
    )
    a("--model", default=None, help="model name to send (default: the server's first model)")
    a("--prompt-format", choices=("ids", "text"), default="ids",
      help="token-id prompts or text (chat always sends text)")  # fmt: skip
    a("--tokenizer", default=None,
      help="tokenizer to render text prompts (HF dir/id, .gguf, or 'default'); "
           "without one, each id becomes a common word")  # fmt: skip
    a("--dataset", choices=("random", "shared-prefix", "trace"), default="random")
    a("--num-prompts", type=int, default=100, help="requests (trace: first N rows)")
    a("--random-input-len", default="64:256", help="N or MIN:MAX tokens")
    a("--random-output-len", default="32:64", help="N or MIN:MAX tokens")
    a("--vocab-size", type=int, default=10000, help="random ids are drawn below this")
    a("--gsp-num-groups", type=int, default=4)
    a("--gsp-prompts-per-group", type=int, default=8)
    a("--gsp-system-prompt-len", type=int, default=512)
    a("--gsp-question-len", type=int, default=32)
    a("--gsp-output-len", type=int, default=32)
    a(
        "--trace-file",
        default=None,
        help="JSONL: timestamp, input_length, output_length[, hash_ids]",
    )
    a("--trace-format", choices=("auto", "mooncake", "qwen"), default="auto",
      help="mooncake: ms timestamps, 512-token blocks; qwen: seconds, 16-token blocks")  # fmt: skip
    a("--trace-block-size", type=int, default=None, help="tokens per hash id (override)")
    a("--trace-time-scale", type=float, default=1.0, help="multiply trace gaps (<1 = faster)")
    a("--request-rate", type=float, default=math.inf, help="req/s, Poisson; inf = all at once")
    a("--sweep-rates", default=None, help="comma-separated rates, one run each (e.g. 1,2,4)")
    a("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    a("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    a("--client-processes", type=int, default=1,
      help="send from this many processes (one event loop each), for bursts of hundreds of "
           "streams that one client loop cannot read in time")  # fmt: skip
    a("--temperature", type=float, default=0.0)
    a("--no-ignore-eos", dest="ignore_eos", action="store_false",
      help="let requests stop at EOS (lengths no longer fixed)")  # fmt: skip
    a("--extra-body", default=None, help="JSON merged into every request body")
    a("--flush-cache", action="store_true", help="POST /flush_cache before each run")
    a("--warmup-requests", type=int, default=1)
    a("--seed", type=int, default=0)
    a("--label", default=None, help="name of this configuration in plots (e.g. the engine)")
    a("--output", default=None, help="result JSON (default: benchmark/online/results/...)")
    a("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    if args.dataset == "trace" and not args.trace_file:
        ap.error("--dataset trace needs --trace-file")
    if args.client_processes < 1:
        ap.error("--client-processes must be at least 1")
    if args.client_processes > 1 and args.max_concurrency:
        ap.error("--max-concurrency needs one client process")
    if args.dataset == "trace" and args.sweep_rates:
        ap.error("trace requests keep their own arrival times; use --trace-time-scale")
    return args


def build_requests(args: argparse.Namespace) -> list[datasets.BenchRequest]:
    if args.dataset == "random":
        return datasets.random_requests(
            args.num_prompts, datasets.parse_range(args.random_input_len),
            datasets.parse_range(args.random_output_len), args.vocab_size, args.seed,
        )  # fmt: skip
    if args.dataset == "shared-prefix":
        return datasets.shared_prefix_requests(
            args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_system_prompt_len,
            args.gsp_question_len, args.gsp_output_len, args.vocab_size, args.seed,
        )  # fmt: skip
    rows = datasets.load_trace_rows(args.trace_file, args.num_prompts)
    return datasets.trace_requests(
        rows, args.vocab_size, args.seed, args.trace_format, args.trace_block_size,
        args.trace_time_scale,
    )  # fmt: skip


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _strict_json(x: Any) -> Any:
    """inf -> "inf", NaN -> null: strict JSON (jq, browsers) has neither."""
    if isinstance(x, float):
        return None if math.isnan(x) else ("inf" if math.isinf(x) else x)
    if isinstance(x, dict):
        return {k: _strict_json(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_strict_json(v) for v in x]
    return x


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    rates = (
        [float(r) for r in args.sweep_rates.split(",")] if args.sweep_rates else [args.request_rate]
    )
    requests = build_requests(args)
    tokenizer = datasets.load_tokenizer(args.tokenizer) if args.tokenizer else None
    async with runner.open_session() as session:
        model = args.model or await served_model(session, args.base_url)
        ep = Endpoint(
            args.base_url, args.backend, model, args.prompt_format, datasets.Renderer(tokenizer),
            args.temperature, args.ignore_eos, json.loads(args.extra_body or "{}"),
        )  # fmt: skip
        await runner.warmup(session, ep, args.warmup_requests, args.vocab_size)
        if len(rates) > 1 and not args.flush_cache:
            print("note: without --flush-cache, later rates reuse the prefix cache of earlier "
                  "ones (same prompts)", file=sys.stderr)  # fmt: skip
        runs = []
        for rate in rates:
            run = await runner.run_rate(
                session, ep, requests, rate, args.max_concurrency, args.seed, args.burstiness,
                args.flush_cache, args.client_processes,
            )  # fmt: skip
            _print_run(run)
            runs.append(run)
    config = {k: v for k, v in vars(args).items() if k not in ("output", "no_plot")}
    config.update(
        model=model, date=datetime.date.today().isoformat(), commit=_commit(),
        machine=f"{platform.machine()} {os.cpu_count()} cpus",
        num_requests=len(requests), input_tokens_requested=sum(r.prompt_len for r in requests),
    )  # fmt: skip
    label = args.label or f"{args.dataset}-{args.backend}"
    return {"label": label, "config": config, "runs": runs}


def _print_run(run: dict[str, Any]) -> None:
    print(f"\n=== {run['schedule']}, max concurrency {run['max_concurrency']} ===")
    print(format_summary(run["summary"]))
    print(f"{'load average (1 min)':<28}{run['loadavg_1m'][0]:>6.1f} -> {run['loadavg_1m'][1]:.1f}")
    if run["errors"]:
        print("errors:", *run["errors"], sep="\n  ")
    if run["server"] is not None:
        print(server_metrics.format_comparison(run["client"], run["server"]))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(bench(args))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.output or RESULTS_DIR / f"{result['label']}-{stamp}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_strict_json(result), indent=1))
    print(f"\nresult: {out}")
    if not args.no_plot:
        from benchmark.online.plots import plot_results

        print(f"plot:   {plot_results([_strict_json(result)], out.with_suffix('.png'))}")
    failed = sum(run["summary"]["failed"] for run in result["runs"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
