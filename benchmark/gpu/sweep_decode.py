"""Decode-attention tile sweep on the GPU: KV bandwidth per (BLOCK_N, warps, stages).

python benchmark/gpu/sweep_decode.py     # Qwen3-0.6B heads (Hq 16, Hk 8, D 128), bf16
"""

from __future__ import annotations

import functools
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    import triton.testing

    from minisgl.attention.triton_plan import decode_split_cap, plan_decode_splits
    from minisgl.kernels.decode_attention import decode_attention

    hq, hk, d = 16, 8, 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for bsz, seq in ((256, 1024), (128, 2048), (64, 4096), (8, 4096), (1, 4096)):
        k_cache = torch.randn(bsz * seq + 1, hk, d, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(bsz * seq, device="cuda").view(bsz, seq)  # page size 1, shuffled
        rows = torch.arange(bsz, device="cuda", dtype=torch.int32)
        seq_lens = torch.full((bsz,), seq, device="cuda", dtype=torch.int32)
        q = torch.randn(bsz, hq, d, device="cuda", dtype=torch.bfloat16)
        gb = bsz * seq * hk * d * 2 * 2 / 1e9
        results = []
        for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)):
            max_splits = decode_split_cap(bsz, hk, sms, 16)
            plan = plan_decode_splits([seq] * bsz, hk, sms, max_splits, 256, block_n)
            splits = torch.tensor(plan, device="cuda", dtype=torch.int32)

            run = functools.partial(
                decode_attention, q, k_cache, v_cache, table, rows, seq_lens, splits,
                max_splits, d**-0.5, block_n=block_n, num_warps=warps, num_stages=stages,
            )  # fmt: skip

            try:
                ms = triton.testing.do_bench(run, warmup=10, rep=40)
            except Exception as e:  # out of resources for this tile
                print(f"  B={bsz} seq={seq} n={block_n} w={warps} s={stages}: {type(e).__name__}")
                continue
            results.append((ms, block_n, warps, stages))
        results.sort()
        best = ", ".join(
            f"n{n}/w{w}/s{s} {ms * 1e3:.0f}us {gb / ms:.2f}TB/s" for ms, n, w, s in results[:4]
        )
        cur = next(r for r in results if r[1:] == (64, 4, 2))
        print(f"B={bsz} seq={seq}: current {cur[0] * 1e3:.0f}us {gb / cur[0]:.2f}TB/s | {best}")


if __name__ == "__main__":
    main()
