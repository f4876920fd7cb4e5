"""The seeds' offline workload: 256 random-token requests, throughput in output tokens/s.

    python benchmark/offline/bench.py --model benchmark/configs/Qwen3-0.6B --load-format dummy
    python benchmark/offline/bench.py --num-requests 16 --scale 0.1      # CPU, default model

random.seed(0); prompts of randint(100, 1024) ids in [0, 10000]; then max_tokens
randint(100, 1024); temperature 0.6, ignore_eos. At full size: 142,827 input and 133,966
output tokens. ``--scale`` shrinks both lengths (for CPU runs) keeping the shape.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.report import add_engine_arg, commit, emit, engine_options  # noqa: E402
from minisgl import LLM, SamplingParams  # noqa: E402


def workload(
    num_requests: int = 256, scale: float = 1.0, vocab: int = 10000
) -> tuple[list[list[int]], list[int]]:
    random.seed(0)
    prompts = [
        [random.randint(0, vocab) for _ in range(random.randint(100, 1024))] for _ in range(256)
    ]
    max_tokens = [random.randint(100, 1024) for _ in range(256)]
    prompts, max_tokens = prompts[:num_requests], max_tokens[:num_requests]
    if scale != 1.0:
        prompts = [p[: max(1, int(len(p) * scale))] for p in prompts]
        max_tokens = [max(1, int(m * scale)) for m in max_tokens]
    return prompts, max_tokens


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply prompt and output lengths")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--output", default=None, help="append a JSON line with the result here")
    ap.add_argument(
        "--profile", type=int, default=0, metavar="N", help="cProfile the run, print top N"
    )
    add_engine_arg(ap)
    args = ap.parse_args()

    options = engine_options(args.engine_arg, load_format=args.load_format, context_length=4096)
    llm = LLM(args.model, **options)  # type: ignore[arg-type]
    vocab = min(10000, llm.engine.model_config.vocab_size - 1)
    prompts, max_tokens = workload(args.num_requests, args.scale, vocab)
    params = [
        SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=m)
        for m in max_tokens
    ]
    llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.6, max_tokens=16), use_tqdm=False)
    stats0 = dict(llm.scheduler.stats)
    profiler = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    out = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    if profiler is not None:
        profiler.disable()
        # Host time by function: where a CPU-bound step goes (cumulative, then own time).
        for key in ("cumulative", "tottime"):
            pstats.Stats(profiler).sort_stats(key).print_stats(args.profile)
    out_tokens = sum(len(r["token_ids"]) for r in out)
    assert out_tokens == sum(max_tokens), (out_tokens, sum(max_tokens))
    result = {
        "bench": "offline",
        "model": args.model or "default (SmolLM2-135M-Instruct Q4_1 GGUF)",
        "num_requests": len(prompts),
        "scale": args.scale,
        "input_tokens": sum(map(len, prompts)),
        "output_tokens": out_tokens,
        "seconds": round(elapsed, 3),
        "output_tok_s": round(out_tokens / elapsed, 1),
        "device": str(llm.engine.device),
        "options": options,
        "host": {k: round(v - stats0[k], 3) for k, v in llm.scheduler.stats.items()},
        "commit": commit(),
    }
    print(f"{out_tokens} output tokens in {elapsed:.2f}s: {out_tokens / elapsed:,.1f} tok/s")
    emit(result, args.output)


if __name__ == "__main__":
    main()
