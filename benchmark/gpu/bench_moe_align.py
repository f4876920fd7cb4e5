"""Time kernels/moe_align.moe_align_block_size (the routed pairs grouped by expert, each run
padded to BLOCK_M) at Qwen3-30B-A3B's routing (128 experts, top-8), inside a CUDA graph: the
cost a MoE layer pays before its two GEMMs, at decode and prefill token counts.

    python benchmark/gpu/bench_moe_align.py [--experts 128 --top-k 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd()))  # the tree in the working directory (new or old)

from benchmark.gpu.bench_gemv import graph_time_us  # noqa: E402
from minisgl.kernels.moe import _block_m  # noqa: E402
from minisgl.kernels.moe_align import moe_align_block_size  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    for tokens in (1, 64, 256, 2048, 16384):
        logits = torch.randn(tokens, args.experts, device="cuda", generator=g)
        ids = torch.topk(logits, args.top_k, dim=1).indices
        block_m = _block_m(ids.numel(), args.experts)
        us = graph_time_us(lambda i=ids, b=block_m: moe_align_block_size(i, args.experts, b))
        print(f"tokens {tokens:6d} (BLOCK_M {block_m}): {us:8.1f} us")


if __name__ == "__main__":
    main()
