"""Batch-1 decode: how the scheduler's host time per step compares with the device's.

    python benchmark/offline/host_bs1.py --model benchmark/configs/Qwen3-0.6B --load-format dummy

With overlap scheduling a step's host work (schedule, build, launch; then process the step
before) runs while the device computes. The scheduler's own timers split each step into
launch (schedule + build + enqueue), wait (blocked on the device's result: the device is the
bound) and process (results). Wait near zero means the host is the bound at batch 1. With
``--parts`` it times the stages of a step on the host (each inclusive of what it calls,
perf_counter around the call: about a microsecond of overhead each); with ``--profile``
it prints the host functions that take the most time (cProfile, which slows the host:
read it for shares, not for totals).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.report import add_engine_arg, engine_options  # noqa: E402
from minisgl import LLM, SamplingParams  # noqa: E402


def timed_parts(totals: dict[str, float], calls: Counter[str]) -> None:
    """Wrap the host stages of a step with timers (this process only)."""
    import torch

    from minisgl.attention.triton_backend import TritonBackend
    from minisgl.engine.cuda_graph import CudaGraphRunner
    from minisgl.engine.engine import Engine
    from minisgl.engine.sampler import Sampler
    from minisgl.engine.step import PendingStep
    from minisgl.kernels.staging import DeviceStager
    from minisgl.scheduler.kv_manager import KVManager
    from minisgl.scheduler.results import Results
    from minisgl.scheduler.scheduler import Scheduler
    from minisgl.scheduler.step_builder import StepBuilder

    parts: list[tuple[type, str]] = [
        (Scheduler, "_schedule"), (KVManager, "allocate_batch"), (StepBuilder, "build"),
        (KVManager, "flush"), (Engine, "forward"), (DeviceStager, "stage_flat"),
        (Engine, "run_model"), (TritonBackend, "prepare"), (CudaGraphRunner, "run"),
        (torch.cuda.CUDAGraph, "replay"), (Engine, "_sample"), (Sampler, "sample"),
        (PendingStep, "__init__"), (Scheduler, "_process"), (PendingStep, "result"),
        (Results, "apply"),
    ]  # fmt: skip

    def wrap(cls: type, name: str) -> None:
        fn: Callable[..., object] = getattr(cls, name)
        key = f"{cls.__name__}.{name}"

        @functools.wraps(fn)
        def timed(*args: object, **kwargs: object) -> object:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[key] = totals.get(key, 0.0) + time.perf_counter() - t0
                calls[key] += 1

        setattr(cls, name, timed)

    for cls, name in parts:
        if hasattr(cls, name):
            wrap(cls, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--parts", action="store_true")
    add_engine_arg(ap)
    args = ap.parse_args()
    options = engine_options(args.engine_arg, load_format=args.load_format, context_length=4096)
    llm = LLM(args.model, **options)  # type: ignore[arg-type]
    prompt = [(7 * i) % 1000 + 10 for i in range(128)]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    totals: dict[str, float] = {}  # seconds
    calls: Counter[str] = Counter()
    if args.parts:
        timed_parts(totals, calls)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    totals.clear()
    calls.clear()
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
    for key, total in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {key:32s} {total / steps * 1e6:8.1f} us/step  ({calls[key] / steps:.1f} calls)")
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        pstats.Stats(prof).sort_stats("cumtime").print_stats(45)


if __name__ == "__main__":
    main()
