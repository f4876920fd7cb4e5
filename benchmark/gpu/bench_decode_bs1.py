"""Decode attention at batch 1: the latency of one layer's split + reduce launches, over
tiles and the split plan's minimum chunk, for the contexts a batch-1 chat sees.

    python benchmark/gpu/bench_decode_bs1.py [--contexts 200 1000 4000]

At batch 1 the kernel moves little data (200 tokens of 8 KV heads: 0.8 MB in bf16) and its
time is the latency of its dependent loads (page table, then K/V) per tile a program walks.
Each variant is captured as a CUDA graph of ``--layers`` launches in a row, as a step makes
them (with PDL where the engine uses it), and timed per launch; its output is checked
against the engine's launch. Heads of Qwen3-0.6B (16 / 8) and Qwen3-8B (32 / 8), D 128.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# (BLOCK_N, warps, stages, min_split_tokens); the first is the engine's launch at batch 1.
VARIANTS = [
    (32, 4, 2, 64),
    (64, 4, 2, 64),
    (32, 4, 2, 32),
    (64, 4, 1, 64),
    (64, 2, 2, 64),
    (32, 2, 2, 32),
    (64, 4, 2, 128),
    (128, 4, 3, 128),
]


def make_case(context: int, hq: int, hk: int, d: int = 128) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    pool = 4 * context + 1
    k = torch.randn(pool, hk, d, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(pool, hk, d, device="cuda", generator=g).to(torch.bfloat16)
    slots = torch.randperm(pool, device="cuda", generator=g)[:context].to(torch.int32)
    return {
        "q": torch.randn(1, hq, d, device="cuda", generator=g).to(torch.bfloat16),
        "k": k,
        "v": v,
        "table": slots.view(1, context),
        "rows": torch.zeros(1, device="cuda", dtype=torch.int32),
        "lens": torch.full((1,), context, device="cuda", dtype=torch.int32),
    }


def launcher(case: dict[str, torch.Tensor], variant: tuple[int, int, int, int]):  # noqa: ANN201
    from minisgl.attention.triton_plan import decode_split_cap, plan_decode_splits
    from minisgl.kernels.decode_attention import decode_attention

    block_n, warps, stages, min_split = variant
    hk = case["k"].shape[1]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cap = decode_split_cap(1, hk, sms, 16)
    context = int(case["table"].shape[1])
    plan = plan_decode_splits([context], hk, sms, cap, min_split, block_n, batch=1)
    splits = torch.tensor(plan, device="cuda", dtype=torch.int32)
    out = torch.empty_like(case["q"])

    def run() -> torch.Tensor:
        return decode_attention(
            case["q"], case["k"], case["v"], case["table"], case["rows"], case["lens"],
            splits, cap, 128**-0.5, block_n=block_n, num_warps=warps, num_stages=stages,
            out=out,
        )  # fmt: skip

    return run, plan[0]


def time_graph(run, layers: int, reps: int = 50) -> float:  # noqa: ANN001
    """µs per launch of ``layers`` launches captured in one graph (median of ``reps``)."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(layers):
            run()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / layers)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--contexts", type=int, nargs="+", default=[200, 1000, 4000])
    ap.add_argument("--layers", type=int, default=28)
    args = ap.parse_args()
    print(f"device {torch.cuda.get_device_name()}")
    for hq, hk in ((16, 8), (32, 8)):
        for context in args.contexts:
            case = make_case(context, hq, hk)
            ref = None
            cells = []
            for variant in VARIANTS:
                run, splits = launcher(case, variant)
                got = run().float().clone()
                ref = got if ref is None else ref
                err = ((got - ref).norm() / ref.norm()).item()
                us = time_graph(run, args.layers)
                bad = "" if err < 1e-2 else f" ERR {err:.1e}"
                cells.append(f"{variant} s{splits} {us:.2f}{bad}")
            print(f"Hq {hq} Hk {hk} context {context}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
