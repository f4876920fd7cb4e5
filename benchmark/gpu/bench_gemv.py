"""Skinny GEMM on the H200: cuBLAS (F.linear) vs the Triton GEMV (kernels/gemv.py) on the
linear layers of Qwen3-0.6B and Qwen3-8B, timed inside CUDA graphs (as decode runs them: a
Triton launch costs 30-60 us of host time, more than these kernels take on the GPU).

    python benchmark/gpu/bench_gemv.py [--rows 1 2 4] [--write-table table.json]
    MINISGL_TRITON_GEMV=1 MINISGL_GEMV_TABLE=table.json python benchmark/offline/bench_latency.py ...

--write-table keeps, per shape and row count, the fastest tiles where they beat cuBLAS by
at least 3%, else null (cuBLAS): the table kernels/gemv.py reads from MINISGL_GEMV_TABLE.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = {
    "0.6B qkv": (4096, 1024),
    "0.6B o": (1024, 2048),
    "0.6B gate_up": (6144, 1024),
    "0.6B down": (1024, 3072),
    "0.6B lm_head": (151936, 1024),
    "8B qkv": (6144, 4096),
    "8B o": (4096, 4096),
    "8B gate_up": (24576, 4096),
    "8B down": (4096, 12288),
    "8B lm_head": (151936, 4096),
}


def graph_time_us(fn: object) -> float:
    import triton.testing

    fn()  # compile outside the capture  # type: ignore[operator]
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=30)) * 1e3  # type: ignore[arg-type]


def main() -> None:
    from minisgl.kernels.gemv import gemv, gemv_tiles

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--write-table", default=None)
    args = ap.parse_args()
    bf = torch.bfloat16
    table = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=bf) / k**0.5
        gb = n * k * 2 / 1e9
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=bf)
            ref = torch.nn.functional.linear(x, w)
            torch.testing.assert_close(gemv(x, w), ref, atol=2e-2, rtol=2e-2)
            t_cublas = graph_time_us(lambda x=x, w=w: torch.nn.functional.linear(x, w))
            bm = gemv_tiles(rows)[0]
            configs = [gemv_tiles(rows)] + [
                (bm, bn, bk, wp, st)
                for bn, bk, wp, st in itertools.product(
                    (2, 4, 8, 16), (512, 1024, 2048), (4, 8), (3, 4)
                )
                if bm * bn * bk <= 16384
            ]
            results = []
            for cfg in dict.fromkeys(configs):
                try:
                    t = graph_time_us(lambda c=cfg, x=x, w=w: gemv(x, w, None, c))
                except Exception as e:  # out of registers or shared memory for this tile
                    print(f"  {name} {cfg}: {type(e).__name__}")
                    continue
                results.append((t, cfg))
            results.sort()
            best_t, best_c = results[0]
            top = ", ".join(f"{c[1:]} {t:.1f}" for t, c in results[:4])
            print(
                f"{name:13s} M={rows}: cuBLAS {t_cublas:6.1f} us ({gb / t_cublas * 1e3:.2f} TB/s)"
                f" | best {best_t:6.1f} us ({gb / best_t * 1e3:.2f}) | top {top}",
                flush=True,
            )
            table.append([rows, n, k, list(best_c) if best_t < 0.97 * t_cublas else None])
    if args.write_table:
        Path(args.write_table).write_text(json.dumps(table))


if __name__ == "__main__":
    main()
