"""Time to first token of a shared-prefix workload, radix prefix cache vs no reuse.

32 requests (by default) behind one 512-token system prompt, each with its own short
question, all submitted at once; greedy, a few output tokens each.

    python benchmark/offline/bench_shared_prefix.py --cache radix
    python benchmark/offline/bench_shared_prefix.py --cache naive
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.report import emit  # noqa: E402
from minisgl import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--cache", default="radix")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--question", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    llm = LLM(args.model, cache=args.cache)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    system = [rng.randrange(100, vocab) for _ in range(args.prefix)]
    prompts = [
        system + [rng.randrange(100, vocab) for _ in range(args.question)]
        for _ in range(args.requests)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    sched = llm.scheduler
    before = sched.prefill_tokens
    start = time.perf_counter()
    reqs = [sched.add_request(p, params) for p in prompts]
    first: dict[int, float] = {}
    while not all(r.finished for r in reqs):
        for r in sched.step():
            if r.uid not in first and r.output_ids:
                first[r.uid] = time.perf_counter() - start
    sched.drain()
    total = time.perf_counter() - start
    ttft = [first[r.uid] * 1000 for r in reqs]
    result = {
        "bench": "shared_prefix_ttft",
        "cache": args.cache,
        "requests": args.requests,
        "prefix": args.prefix,
        "question": args.question,
        "mean_ttft_ms": round(statistics.mean(ttft), 1),
        "p50_ttft_ms": round(statistics.median(ttft), 1),
        "max_ttft_ms": round(max(ttft), 1),
        "total_s": round(total, 2),
        "prefill_tokens_computed": sched.prefill_tokens - before,
    }
    emit(result, args.output)


if __name__ == "__main__":
    main()
