"""Decode attention at batch 1: the latency of one layer's split + reduce launches, over
tiles and the split plan's minimum chunk, for the contexts a batch-1 chat sees.

    python benchmark/gpu/bench_decode_bs1.py [--contexts 200 1000 4000] [--batches 1 4] [--fold]

At batch 1 the kernel moves little data (200 tokens of 8 KV heads: 0.8 MB in bf16) and its
time is the latency of its dependent loads (page table, then K/V) per tile a program walks.
Each variant is captured as a CUDA graph of ``--layers`` launches in a row, as a step makes
them (with PDL where the engine uses it), and timed per launch; its output is checked
against the first variant's. Heads of Qwen3-0.6B (16 / 8) and Qwen3-8B (32 / 8), D 128;
``--batches``: rows of the same context (the tiles are picked by the split axis, which
depends on the batch size only). "engine" marks the engine's pick at this commit; a
min_split_tokens of NO_SPLIT times the kernel with no split axis and no reduction launch.
``--fold``: at the engine's tile only, one layer's q/k norm + RoPE + K/V store and attention
as the fused store kernel then the decode launches, against the decode kernel with them
folded in (on unless ``--disable-fused-decode-rope``, kernels/decode_fold.py).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.gpu.bench_gemv import graph_time_us  # noqa: E402

NO_SPLIT = 1 << 20  # a min_split_tokens that no context reaches: the grid's split axis is 1

# (BLOCK_N, warps, stages, min_split_tokens); the first was the engine's at batch 1 before
# FEW_ROWS_SPLITS (attention/triton_plan.py).
VARIANTS = [
    (32, 4, 2, 64),
    (64, 4, 2, 64),
    (32, 4, 2, 32),
    (64, 4, 1, 64),
    (64, 2, 2, 64),
    (32, 2, 2, 32),
    (64, 4, 2, 128),
    (128, 4, 3, 128),
    # No split at all: one program per row and KV head walks the whole context and writes
    # the output itself (no reduction launch), as a graph captured with one split would.
    (64, 4, 1, NO_SPLIT),
    (64, 4, 2, NO_SPLIT),
    (128, 4, 2, NO_SPLIT),
    (32, 4, 2, NO_SPLIT),
]


def make_case(
    context: int, hq: int, hk: int, batch: int = 1, d: int = 128
) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    pool = 4 * context * batch + 1
    k = torch.randn(pool, hk, d, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(pool, hk, d, device="cuda", generator=g).to(torch.bfloat16)
    slots = torch.randperm(pool, device="cuda", generator=g)[: context * batch].to(torch.int32)
    return {
        "q": torch.randn(batch, hq, d, device="cuda", generator=g).to(torch.bfloat16),
        "k": k,
        "v": v,
        "table": slots.view(batch, context),
        "rows": torch.arange(batch, device="cuda", dtype=torch.int32),
        "lens": torch.full((batch,), context, device="cuda", dtype=torch.int32),
    }


def launcher(case: dict[str, torch.Tensor], variant: tuple[int, int, int, int]):  # noqa: ANN201
    """(attend(q, fold=None): one layer's decode launches at this variant, the row's splits)."""
    from minisgl.attention.triton_plan import plan_decode_splits
    from minisgl.kernels.decode_attention import decode_attention
    from minisgl.kernels.decode_fold import DecodeFold

    block_n, warps, stages, min_split = variant
    hk = case["k"].shape[1]
    batch, context = case["table"].shape
    cap = 1 if min_split >= NO_SPLIT else engine_cap(batch, hk)
    plan = plan_decode_splits([context] * batch, hk, sms(), cap, min_split, block_n, batch=batch)
    splits = torch.tensor(plan, device="cuda", dtype=torch.int32)
    out = torch.empty_like(case["q"])

    def attend(q: torch.Tensor, fold: DecodeFold | None = None) -> torch.Tensor:
        return decode_attention(
            q, case["k"], case["v"], case["table"], case["rows"], case["lens"],
            splits, cap, 128**-0.5, block_n=block_n, num_warps=warps, num_stages=stages,
            out=out, fold=fold,
        )  # fmt: skip

    return attend, plan[0]


def fold_times(
    case: dict[str, torch.Tensor], variant: tuple[int, int, int, int], layers: int
) -> tuple[float, float, float]:
    """(µs separate, µs folded, relative difference of the outputs) of one layer's q/k
    norm + RoPE + K/V store and attention, from a raw QKV row per request (Qwen3's q/k
    norm; the new token at each row's last position)."""
    from minisgl.kernels.decode_fold import DecodeFold
    from minisgl.kernels.qk_rope_store import fused_qk_norm_rope_store
    from minisgl.layers.rotary import RotaryEmbedding
    from minisgl.models.config import RopeConfig

    batch, hq, d = case["q"].shape
    hk, context = case["k"].shape[1], case["table"].shape[1]
    g = torch.Generator(device="cuda").manual_seed(1)
    qkv = torch.randn(batch, (hq + 2 * hk) * d, device="cuda", generator=g).to(torch.bfloat16)
    q, k, v = (x.view(batch, -1, d) for x in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    emb = RotaryEmbedding(d, RopeConfig(theta=1e6), context)
    rope = (case["lens"].long() - 1, emb.cos_table.cuda(), emb.sin_table.cuda())
    slots = case["table"][:, context - 1]
    w = (1 + 0.1 * torch.randn(d, device="cuda", generator=g)).to(torch.bfloat16)
    attend, _ = launcher(case, variant)
    fold = DecodeFold(k, v, slots, *rope, w, w, 1e-6)

    def separate() -> torch.Tensor:
        cache = (case["k"], case["v"], slots)
        return attend(fused_qk_norm_rope_store(q, k, v, *rope, *cache, w, w, 1e-6))

    def folded() -> torch.Tensor:
        return attend(q, fold)

    ref = separate().float().clone()
    err = ((folded().float() - ref).norm() / ref.norm()).item()
    return time_graph(separate, layers), time_graph(folded, layers), err


def sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def engine_cap(batch: int, hk: int) -> int:
    from minisgl.attention.base import padded_batch_size
    from minisgl.attention.triton_plan import decode_split_cap

    return decode_split_cap(padded_batch_size(batch), hk, sms(), 16)


def time_graph(run: Callable[[], object], layers: int) -> float:
    """µs per launch of ``layers`` launches captured in one graph (bench_gemv's timing)."""
    return graph_time_us(lambda: [run() for _ in range(layers)]) / layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--contexts", type=int, nargs="+", default=[200, 1000, 4000])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--batches", type=int, nargs="+", default=[1])
    ap.add_argument("--fold", action="store_true", help="separate vs folded q/k norm + RoPE")
    args = ap.parse_args()
    from minisgl.attention.triton_plan import decode_tiles

    print(f"device {torch.cuda.get_device_name()}")
    for hq, hk, batch, context in itertools.product((16, 32), (8,), args.batches, args.contexts):
        case = make_case(context, hq, hk, batch)
        engine = (*decode_tiles(engine_cap(batch, hk)), 64)
        if args.fold:
            sep, fol, err = fold_times(case, engine, args.layers)
            bad = "" if err < 1e-2 else f" ERR {err:.1e}"
            print(f"Hq {hq} Hk {hk} B{batch} x {context}: engine {engine} separate {sep:.2f}, "
                  f"folded {fol:.2f}{bad}", flush=True)  # fmt: skip
            continue
        ref = None
        cells = []
        for variant in [engine] + [v for v in VARIANTS if v != engine]:
            attend, splits = launcher(case, variant)
            run = functools.partial(attend, case["q"])
            got = run().float().clone()
            ref = got if ref is None else ref
            err = ((got - ref).norm() / ref.norm()).item()
            us = time_graph(run, args.layers)
            bad = "" if err < 1e-2 else f" ERR {err:.1e}"
            tag = "engine " if variant == engine else ""
            cells.append(f"{tag}{variant} s{splits} {us:.2f}{bad}")
        print(f"Hq {hq} Hk {hk} B{batch} x {context}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
