"""Batch-1 decode: how the scheduler's host time per step compares with the device's.

    python benchmark/offline/host_bs1.py --model benchmark/configs/Qwen3-0.6B --load-format dummy

With overlap scheduling a step's host work (schedule, build, launch; then process the step
before) runs while the device computes. The scheduler's own timers split each step into
launch (schedule + build + enqueue), wait (blocked on the device's result: the device is the
bound) and process (results). Wait near zero means the host is the bound at batch 1. With
``--profile`` it also prints the host functions that take the most time (cProfile, which
slows the host: read it for shares, not for totals).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.report import add_engine_arg, engine_options  # noqa: E402
from minisgl import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--profile", action="store_true")
    add_engine_arg(ap)
    args = ap.parse_args()
    options = engine_options(args.engine_arg, load_format=args.load_format, context_length=4096)
    llm = LLM(args.model, **options)  # type: ignore[arg-type]
    prompt = [(7 * i) % 1000 + 10 for i in range(128)]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    stats = llm.scheduler.stats  # type: ignore[union-attr]
    before = dict(stats)
    prof = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    llm.generate([prompt], params, use_tqdm=False)
    if prof is not None:
        prof.disable()
    wall = time.perf_counter() - t0
    steps = stats["steps"] - before["steps"]
    per = {k: (stats[k] - before[k]) / steps * 1e3 for k in ("launch_s", "wait_s", "process_s")}
    print(
        f"{steps} steps, wall {wall / steps * 1e3:.3f} ms/step: launch {per['launch_s']:.3f}, "
        f"wait {per['wait_s']:.3f}, process {per['process_s']:.3f} ms/step"
    )
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        pstats.Stats(prof).sort_stats("cumtime").print_stats(45)


if __name__ == "__main__":
    main()
