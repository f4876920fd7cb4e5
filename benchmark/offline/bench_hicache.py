"""HiCache off vs on: a multi-turn workload whose working set is several times the device
pool, so every conversation's history has left the device before its next turn.

``--conversations`` conversations of ``--history`` tokens each take ``--turns`` turns, one
turn of every conversation after another (all of a turn's requests submitted at once): a
turn's prompt is the conversation so far plus ``--question`` new tokens, and it generates
``--max-tokens`` greedy tokens. The device pool holds ``--device-share`` of the final working
set (a quarter by default); with HiCache on, a host tier of ``--hicache-size`` GiB holds all
of it. Reported per run: prefill tokens computed, TTFT p50/p99 (from each turn's
submission), total time, bytes moved each way; then on/off ratios. An untimed warm-up pass
runs first.

    python benchmark/offline/bench_hicache.py --tiny /tmp/hicache-model   # CPU, tiny model
    python benchmark/offline/bench_hicache.py --model benchmark/configs/Qwen3-8B \\
        --engine-arg load_format=dummy --conversations 64 --turns 6 --history 2000
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.report import add_engine_arg, emit, engine_options  # noqa: E402
from minisgl import LLM, SamplingParams  # noqa: E402


def tiny_model(path: Path) -> str:
    """A random-weight Llama (256-wide, 4 layers) for CPU runs, built once."""
    if not (path / "config.json").exists():
        from tests.helpers import make_tiny_model

        dims = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4)
        make_tiny_model(path, "llama", max_position_embeddings=8192, **dims)
    return str(path)


def run(llm: LLM, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    vocab = min(llm.engine.model_config.vocab_size, 32000)
    history = [
        [rng.randrange(3, vocab) for _ in range(args.history)] for _ in range(args.conversations)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    sched = llm.scheduler
    before = sched.prefill_tokens
    ttft: list[float] = []
    start = time.perf_counter()
    for _ in range(args.turns):
        for h in history:
            h += [rng.randrange(3, vocab) for _ in range(args.question)]
        submitted = time.perf_counter()
        reqs = [sched.add_request(list(h), params) for h in history]
        first: dict[int, float] = {}
        while not all(r.finished for r in reqs):
            for r in sched.step():
                if r.uid not in first and r.output_ids:
                    first[r.uid] = time.perf_counter() - submitted
        sched.drain()
        ttft += [first[r.uid] * 1000 for r in reqs]
        for h, r in zip(history, reqs):
            h += r.output_ids
    total = time.perf_counter() - start
    sched.check_integrity()
    q = statistics.quantiles(ttft, n=100)
    return {
        "prefill_tokens_computed": sched.prefill_tokens - before,
        "ttft_p50_ms": round(statistics.median(ttft), 1),
        "ttft_p99_ms": round(q[98], 1),
        "total_s": round(total, 2),
        "bytes_to_host": sched.totals.get("hicache_bytes_to_host", 0),
        "bytes_to_device": sched.totals.get("hicache_bytes_to_device", 0),
        "host_loaded_tokens": sched.totals.get("hicache_loaded_tokens", 0),
        "outputs": [h[-args.max_tokens :] for h in history],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tiny", type=Path, default=None, help="build/use a tiny model here")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--history", type=int, default=512)
    ap.add_argument("--question", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--device-share", type=float, default=0.25)
    ap.add_argument("--hicache-size", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=1, help="untimed passes first")
    ap.add_argument("--runs", default="off,on", help="measured runs in order (the last counts)")
    ap.add_argument("--output", default=None)
    add_engine_arg(ap)
    args = ap.parse_args()
    model = tiny_model(args.tiny) if args.tiny is not None else args.model
    per_turn = args.question + args.max_tokens
    working_set = args.conversations * (args.history + args.turns * per_turn)
    pages = max(2, int(working_set * args.device_share) // args.page_size)
    results = {}
    # The first pass in a process pays for every kernel shape's first use (oneDNN primitives
    # on CPU): a warm-up pass, not timed, so that neither measured run is the first.
    sizes = {"off": 0.0, "on": args.hicache_size}
    runs = [("warm-up", 0.0)] * args.warmup + [(r, sizes[r]) for r in args.runs.split(",")]
    totals: dict[str, list[float]] = {"off": [], "on": []}
    for label, size in runs:
        options = engine_options(
            args.engine_arg, num_pages=pages, page_size=args.page_size, hicache_size=size
        )
        llm = LLM(model, **options)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        llm.scheduler.flush_cache()
        results[label] = run(llm, args)
        totals.setdefault(label, []).append(results[label]["total_s"])
        llm.close()
    off, on = results["off"], results["on"]
    same = off.pop("outputs") == on.pop("outputs")
    emit(
        {
            "bench": "hicache_multi_turn",
            "conversations": args.conversations,
            "turns": args.turns,
            "history": args.history,
            "working_set_tokens": working_set,
            "device_pool_tokens": pages * args.page_size,
            "greedy_outputs_identical": same,
            "off": off,
            "on": on,
            "total_s_runs": {k: v for k, v in totals.items() if k != "warm-up"},
            "prefill_ratio_on_off": round(
                on["prefill_tokens_computed"] / off["prefill_tokens_computed"], 3
            ),
            "ttft_p50_ratio_on_off": round(on["ttft_p50_ms"] / off["ttft_p50_ms"], 3),
        },
        args.output,
    )


if __name__ == "__main__":
    main()
