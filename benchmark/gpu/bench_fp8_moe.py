"""The fused MoE at Qwen3-30B-A3B's expert shapes (128 experts, top 8, hidden 2048,
moe_intermediate 768; one layer's experts: 1.2 GB bf16, 0.6 GB e4m3, past the L2), in CUDA
graphs: bf16 (kernels/moe.py) against the FP8 experts (extensions/quantization/kernels/
fp8_moe.py) at its default tiles and a grid of others, so the FP8 default can be set:

    python benchmark/gpu/bench_fp8_moe.py [--tokens 1 64 256 2048]

Session 20 measured the FP8 kernel 1.3-1.7x faster than bf16 from 64 tokens, its best tiles
within ~4% of the defaults (RESULTS), so the FP8 experts became the default; at decode sizes
(16 pairs an expert) BLOCK_M is 16, where Triton runs e4m3 dots on mma.sync with both
operands unpacked, not on e4m3 wgmma.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.gpu.bench_gemv import graph_time_us  # noqa: E402
from minisgl.kernels import moe  # noqa: E402
from tests.unit.extensions.quantization.test_fp8_moe import fp8_moe_case  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
# (BLOCK_M, BLOCK_N, stages) for the FP8 launches; BLOCK_K is the 128-input group.
GRID = [(bm, bn, st) for bm in (16, 32, 64) for bn in (64, 128) for st in (3, 4)]


def with_tiles(block_m: int, block_n: int, stages: int) -> None:
    moe._block_m = lambda pairs, experts: block_m  # type: ignore[assignment]
    moe._tiles = lambda a, n_out, k_dim, fp8: (block_n, 128, stages)  # type: ignore[assignment]


def time_tokens(tokens: int) -> str:
    """One line: bf16, the FP8 default, the three fastest FP8 tiles of GRID (us)."""
    from minisgl.extensions.quantization.kernels.fp8_moe import fp8_moe

    cuda = torch.device("cuda")
    case = fp8_moe_case(tokens, EXPERTS, TOP_K, HIDDEN, INTER, 128, 128, torch.bfloat16, cuda, 1)
    x, w13, s13, w2, s2, weights, ids, d13, d2 = case
    f13, f2 = d13.bfloat16(), d2.bfloat16()
    del case, d13, d2
    t_bf = graph_time_us(lambda: moe.fused_moe(x, f13, f2, weights, ids))
    run = lambda: fp8_moe(x, w13, s13, w2, s2, weights, ids)  # noqa: E731
    t_def = graph_time_us(run)
    default_block_m, default_tiles = moe._block_m, moe._tiles
    results = []
    for tiles in GRID:
        with_tiles(*tiles)
        try:
            results.append((graph_time_us(run), tiles))
        except Exception as e:  # a tile Triton cannot compile (shared memory)
            print(f"  {tiles}: {type(e).__name__}")
        moe._block_m, moe._tiles = default_block_m, default_tiles  # type: ignore[assignment]
    best = ", ".join(f"{us:.1f} {c}" for us, c in sorted(results)[:3])
    return f"tokens {tokens}: bf16 {t_bf:7.1f} us | FP8 default {t_def:7.1f} | best {best}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 2048])
    for tokens in ap.parse_args().tokens:
        print(time_tokens(tokens), flush=True)


if __name__ == "__main__":
    main()
