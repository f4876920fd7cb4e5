"""Skinny GEMM on the H200: cuBLAS (F.linear) vs the Triton GEMV (kernels/gemv.py) on the
linear layers of Qwen3-0.6B and Qwen3-8B at 1, 2 and 4 rows; tile sweep at 1 row.

    python benchmark/gpu/bench_gemv.py
    MINISGL_TRITON_GEMV=1 python benchmark/offline/bench_latency.py ...   # end to end
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = {
    "0.6B qkv": (4096, 1024),
    "0.6B o": (1024, 2048),
    "0.6B gate_up": (6144, 1024),
    "0.6B down": (1024, 3072),
    "8B qkv": (6144, 4096),
    "8B o": (4096, 4096),
    "8B gate_up": (24576, 4096),
    "8B down": (4096, 12288),
    "8B lm_head": (151936, 4096),
}


def main() -> None:
    import triton.testing

    from minisgl.kernels.gemv import gemv, gemv_tiles

    bf = torch.bfloat16
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=bf) / k**0.5
        gb = n * k * 2 / 1e9
        for rows in (1, 2, 4):
            x = torch.randn(rows, k, device="cuda", dtype=bf)
            ref = torch.nn.functional.linear(x, w)
            torch.testing.assert_close(gemv(x, w), ref, atol=2e-2, rtol=2e-2)
            t_cublas = triton.testing.do_bench(
                lambda x=x, w=w: torch.nn.functional.linear(x, w), rep=20
            )
            results = []
            configs = [gemv_tiles(rows)]
            if rows == 1:
                configs += [
                    (1, bn, bk, wp, st)
                    for bn, bk, wp, st in itertools.product(
                        (2, 4, 8, 16), (512, 1024, 2048), (4, 8), (2, 3, 4)
                    )
                    if bn * bk <= 16384
                ]
            for cfg in dict.fromkeys(configs):
                try:
                    t = triton.testing.do_bench(lambda c=cfg, x=x, w=w: gemv(x, w, None, c), rep=20)
                except Exception as e:  # out of registers for this tile
                    print(f"  {name} {cfg}: {type(e).__name__}")
                    continue
                results.append((t, cfg))
            results.sort()
            if rows == 1:  # the five best tiles and their times, for choosing defaults
                top = ", ".join(f"{c[1:]} {t * 1e3:.1f}" for t, c in results[:5])
                print(f"  {name} M=1 top: {top}", flush=True)
            default = next(t for t, c in results if c == gemv_tiles(rows))
            best_t, best_c = results[0]
            print(
                f"{name:13s} M={rows}: cuBLAS {t_cublas * 1e3:6.1f} us ({gb / t_cublas:.2f} TB/s)"
                f" | gemv default {default * 1e3:6.1f} us ({gb / default:.2f}) | best {best_c}"
                f" {best_t * 1e3:6.1f} us ({gb / best_t:.2f})",
                flush=True,
            )


if __name__ == "__main__":
    main()
