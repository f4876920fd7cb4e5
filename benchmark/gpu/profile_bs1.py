"""Where a batch-1 decode step's time goes on rank 0: kernel time per token by kernel, next
to wall time per token (the rest is gaps between kernels, launch latency, or, with TP,
waiting for the other rank inside the all-reduce). CUDA-graph replays are profiled too.

    python benchmark/gpu/profile_bs1.py --model benchmark/configs/Qwen3-8B --load-format dummy \\
        [--engine-arg tp_size=2]

Prints one JSON line: wall and kernel microseconds per token and the top kernels.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.report import add_engine_arg, engine_options  # noqa: E402
from minisgl import LLM, SamplingParams  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--top", type=int, default=16)
    add_engine_arg(ap)
    args = ap.parse_args()
    options = engine_options(args.engine_arg, load_format=args.load_format, context_length=4096)
    prompt = [(7 * i) % 1000 + 10 for i in range(128)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    with LLM(args.model, **options) as llm:  # type: ignore[arg-type]
        llm.generate([prompt], params, use_tqdm=False)  # warm-up
        sync()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            t0 = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            sync()
            wall = time.perf_counter() - t0
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            entry = per_kernel[ev.name[:90]]
            entry[0] += ev.device_time_total
            entry[1] += 1
    n = args.tokens
    kernel_us = sum(v[0] for v in per_kernel.values())
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[: args.top]
    print(
        json.dumps(
            {
                "bench": "profile_bs1",
                "model": args.model,
                "options": options,
                "wall_us_per_token": round(wall * 1e6 / n, 1),
                "kernel_us_per_token": round(kernel_us / n, 1),
                "kernels_per_token": round(sum(v[1] for v in per_kernel.values()) / n, 1),
                "top": [
                    {"kernel": k, "us_per_token": round(v[0] / n, 1), "calls_per_token": v[1] / n}
                    for k, v in top
                ],
            }
        )
    )


if __name__ == "__main__":
    main()
