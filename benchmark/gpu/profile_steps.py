"""Where a step's GPU time goes: kernel time by category and GPU busy share over a window
of steps, for the offline workload (big batches, then the tail) or batch-1 decode.

    python benchmark/gpu/profile_steps.py --mode offline
    python benchmark/gpu/profile_steps.py --mode bs1 --model benchmark/configs/Qwen3-8B
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.offline.bench import workload  # noqa: E402
from minisgl import LLM, SamplingParams  # noqa: E402

CATEGORIES = (
    ("attn_decode", ("_decode_split",)),
    ("attn_reduce", ("_decode_reduce",)),
    ("attn_extend", ("_extend_kernel",)),
    ("moe", ("moe", "align")),
    ("quant", ("quant",)),
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "sm90", "cublas", "splitk")),
    ("norm", ("rms_norm",)),
    ("rope", ("rope",)),
    ("store_kv", ("store_kv",)),
    ("act", ("silu", "gelu")),
    ("sampling", ("race", "sampl", "softmax", "argmax", "topk", "sort")),
    ("copy", ("memcpy", "memset", "copy", "fill", "index", "gather", "scatter")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def window(llm: LLM, steps: int, label: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    s = llm.scheduler
    torch.cuda.synchronize()
    st0 = dict(s.stats)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            s.step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_cat: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    spans = []
    for e in kernels:
        dur = e.time_range.end - e.time_range.start
        by_cat[category(e.name)] += dur
        by_name[e.name][0] += dur
        by_name[e.name][1] += 1
        spans.append((e.time_range.start, e.time_range.end))
    spans.sort()
    busy, cur_s, cur_e = 0.0, None, None
    for a, b in spans:
        if cur_e is None or a > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    if cur_e is not None:
        busy += cur_e - cur_s
    span = (spans[-1][1] - spans[0][0]) / 1e3 if spans else 0.0
    host = {k: round((v - st0[k]) * 1e3 / steps, 3) for k, v in s.stats.items() if k.endswith("_s")}
    print(
        f"[{label}] {steps} steps, running {len(s.running) if hasattr(s, 'running') else '?'}: "
        f"wall {wall / steps:.3f} ms/step (profiled), kernels {len(kernels) / steps:.0f}/step, "
        f"GPU busy {busy / 1e3 / steps:.3f} ms/step of kernel span {span / steps:.3f}; host ms/step {host}"
    )
    total = sum(by_cat.values())
    # A PDL kernel starts before the one it depends on ends and waits inside: its span counts
    # that wait, so the categories can sum past GPU busy; the excess is such overlap.
    print(f"  categories sum {total / 1e3 / steps:.3f} ms/step (excess over busy: PDL waits)")
    print(
        "  by category (ms/step): "
        + ", ".join(
            f"{c} {v / 1e3 / steps:.3f} ({100 * v / total:.0f}%)"
            for c, v in sorted(by_cat.items(), key=lambda kv: -kv[1])
        )
    )
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:14]
    for name, (dur, n) in top:
        print(
            f"    {dur / 1e3 / steps:8.3f} ms/step {n / steps:6.1f}x {dur / n:8.1f} us  {name[:90]}"
        )


def gaps(llm: LLM) -> None:
    """The whole offline run with a CUDA event pair around every step's forward: GPU time
    inside steps vs idle gaps between them (the GPU waiting for the host)."""
    prompts, mt = workload()
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in mt]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)
    engine = llm.engine
    forward = engine.forward
    marks: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []

    def timed_forward(step, *args, **kwargs):  # type: ignore[no-untyped-def]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = forward(step, *args, **kwargs)
        end.record()
        marks.append((start, end, len(step.input_ids)))
        return out

    engine.forward = timed_forward  # type: ignore[method-assign]
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    torch.cuda.synchronize()
    engine.forward = forward  # type: ignore[method-assign]
    inside = [a.elapsed_time(b) for a, b, _ in marks]
    between = [marks[i][1].elapsed_time(marks[i + 1][0]) for i in range(len(marks) - 1)]
    print(
        f"wall {wall:.3f} s over {len(marks)} steps: GPU inside steps {sum(inside) / 1e3:.3f} s, "
        f"idle between steps {sum(between) / 1e3:.3f} s"
    )
    for lo, hi in ((0, 96), (96, 257), (257, 2049), (2049, 1 << 20)):
        sel = [i for i, (_, _, b) in enumerate(marks[:-1]) if lo <= b < hi]
        if sel:
            ins = sum(inside[i] for i in sel)
            gap = sum(between[i] for i in sel)
            print(
                f"  tokens {lo}-{hi - 1}: {len(sel)} steps, inside {ins / len(sel):.3f} ms/step, "
                f"gap after {gap / len(sel):.3f} ms/step"
            )
    big = sorted(range(len(inside)), key=lambda i: -inside[i])[:5]
    print("  longest steps:", [(marks[i][2], round(inside[i], 2)) for i in big])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("offline", "bs1", "gaps"), default="offline")
    ap.add_argument("--model", default="benchmark/configs/Qwen3-0.6B")
    args = ap.parse_args()
    llm = LLM(
        args.model,
        load_format="dummy",
        context_length=4096,
        chunked_prefill_size=16384,
        cuda_graph_max_bs=256,
    )
    s = llm.scheduler
    if args.mode == "gaps":
        gaps(llm)
        return
    if args.mode == "bs1":
        prompt = [(7 * i) % 1000 + 10 for i in range(128)]
        s.add_request(prompt, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        for _ in range(60):
            s.step()
        window(llm, 40, f"bs1 {args.model}")
        while s.has_work:
            s.step()
        return
    prompts, mt = workload()
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in mt]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)
    for p, sp in zip(prompts, params):
        s.add_request(p, sp)
    done = 0
    for start, label in ((60, "offline B~256"), (640, "offline mid"), (900, "offline tail")):
        while done < start and s.has_work:
            s.step()
            done += 1
        window(llm, 30, label)
        done += 30
    # The rest of the run is not measured: the process exits with it unfinished.


if __name__ == "__main__":
    main()
