"""FP8 products on the H200 at Qwen3-8B's linear shapes (block scales 128 x 128), cold (each
call reads the next of several weight copies, together twice the L2), in CUDA graphs:

    python benchmark/gpu/bench_fp8.py [--rows 1 2 4] [--gemm-rows 16 64 256 2048]
        [--write-table fp8_gemv.json]
    python benchmark/offline/bench_latency.py --fp8-gemv-table fp8_gemv.json ...

The FP8 GEMV (kernels/fp8_gemv.py) at its default tiles and a grid of others, against bf16
cuBLAS; the W8A8 GEMM (kernels/fp8_gemm.py, activation quantization included) against bf16
cuBLAS at larger row counts. --write-table keeps the fastest GEMV tiles per shape and rows.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.gpu.bench_gemv import L2_BYTES, SHAPES, graph_time_us, rotating  # noqa: E402
from minisgl.extensions.quantization.kernels import fp8_gemm, fp8_gemv, fp8_gemv_tc  # noqa: E402
from minisgl.kernels.fp8_kv import BITS_ASM, CVT  # noqa: E402

SIZES = [(8, 1024, 4), (4, 2048, 4), (8, 2048, 8), (16, 1024, 8), (4, 1024, 4), (8, 512, 4),
         (16, 1024, 4), (16, 2048, 8), (32, 1024, 8)]  # fmt: skip
# (BLOCK_N, BLOCK_K, warps, stages, PREFETCH, R); R = 1 only at <= 64 accumulators a thread.
GRID = [(bn, bk, w, 1, p, r) for (bn, bk, w), p, r in itertools.product(SIZES, (0, 1), (1, 16))
        if r > 1 or bn * bk <= 64 * 32 * w]  # fmt: skip

# fp8_gemv_tc.py's (BLOCK_N, BLOCK_K, warps, stages, MODE) (--tc).
TC_GRID = [(bn, 128, w, st, mode) for bn, w in ((16, 4), (32, 4), (64, 4), (64, 8), (128, 4))
           for st in (3, 5) for mode in (0, CVT, BITS_ASM)]  # fmt: skip


GEMM_QGMMA_GRID = [(64, bn, 4, st) for bn in (16, 32, 64) for st in (3, 5)]


def tc_sweep(name: str, x: torch.Tensor, qs: list[tuple[torch.Tensor, torch.Tensor]],
             gb: float) -> tuple[int, ...] | None:  # fmt: skip
    """The tensor-core GEMV at its default tiles and TC_GRID, beside the CUDA-core GEMV;
    the fastest tiles."""
    rows, copies = x.shape[0], len(qs)
    want = fp8_gemv.fp8_gemv(x[:4], *qs[0]).float()
    results = []
    for cfg in [None, *TC_GRID]:
        run = rotating(lambda q, x=x, t=cfg: fp8_gemv_tc.fp8_gemv_tc(x, *q, tiles=t), qs)
        try:
            got = fp8_gemv_tc.fp8_gemv_tc(x, *qs[0], tiles=cfg)[:4].float()
            if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max()):
                print(f"  tc {cfg}: WRONG RESULT")
                continue
            results.append((graph_time_us(run) / copies, cfg))
        except Exception as e:  # a tile Triton cannot compile (shared memory, registers)
            print(f"  tc {cfg}: {type(e).__name__}: {str(e)[:60]}")
    for gemm in GEMM_QGMMA_GRID:  # the W8A8 GEMM at 64-row tiles (e4m3 wgmma), quantizer included
        run = rotating(lambda q, x=x, t=gemm: fp8_gemm.fp8_gemm(x, *q, tiles=t), qs)
        try:
            results.append((graph_time_us(run) / copies, ("gemm", *gemm)))
        except Exception as e:
            print(f"  tc gemm {gemm}: {type(e).__name__}: {str(e)[:60]}")
    if not results:
        return None
    t_def, best = results[0][0], sorted(results[1:])[:5]
    print(f"{name} rows {rows}: TC default {t_def:6.1f} us ({gb / t_def * 1e3:.2f} TB/s) | "
          + ", ".join(f"{t:.1f} ({gb / t * 1e3:.2f}) {c}" for t, c in best), flush=True)  # fmt: skip
    return next((c for _, c in best if c[0] != "gemm"), None)


def fp8_copies(n: int, k: int, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(n + k)
    out = []
    for _ in range(copies):
        q = (torch.randn(n, k, device="cuda", generator=g) * 64).to(torch.float8_e4m3fn)
        out.append((q, torch.rand(n // 128, k // 128, device="cuda", generator=g) * 1e-3))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1])
    ap.add_argument("--gemm-rows", type=int, nargs="*", default=[16, 64, 256, 2048])
    ap.add_argument("--write-table", default=None)
    ap.add_argument("--tc", type=int, nargs="*", default=[], help="rows for the TC sweep")
    ap.add_argument("--write-tc-table", default=None, help="the TC sweep's best, first rows")
    args = ap.parse_args()
    table: list[list[object]] = []
    tc_table: list[list[object]] = []
    for name in ("8B qkv", "8B o", "8B gate_up", "8B down"):
        n, k = SHAPES[name]
        copies = max(2, -(-2 * L2_BYTES // (n * k)))
        qs = fp8_copies(n, k, copies)
        ws = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(-(-copies // 2))
        ]
        gb = n * k / 1e9  # bytes of e4m3 weights, in GB
        for i, rows in enumerate(args.tc):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            best_tc = tc_sweep(name, x, qs, gb)
            if i == 0 and best_tc is not None:
                tc_table.append([n, k, list(best_tc)])
        for rows in args.rows + args.gemm_rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            t_bf = graph_time_us(rotating(lambda w, x=x: x @ w.T, ws)) / len(ws)
            if rows > fp8_gemv.MAX_ROWS:
                t = graph_time_us(rotating(lambda q, x=x: fp8_gemm.fp8_gemm(x, *q), qs)) / copies
                print(f"{name} rows {rows}: GEMM {t:7.1f} us vs bf16 cuBLAS {t_bf:7.1f}")
                continue
            results = []
            want = fp8_gemv.fp8_gemv(x, *qs[0]).float()
            for cfg in [None, *GRID]:
                tiles = None if cfg is None else (rows, *cfg)
                run = rotating(lambda q, x=x, t=tiles: fp8_gemv.fp8_gemv(x, *q, tiles=t), qs)
                try:
                    got = fp8_gemv.fp8_gemv(x, *qs[0], tiles=tiles).float()
                    if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max()):
                        print(f"  {cfg}: WRONG RESULT")
                        continue
                    results.append((graph_time_us(run) / copies, cfg))
                except Exception as e:  # a tile Triton cannot compile (shared memory)
                    print(f"  {cfg}: {type(e).__name__}")
            t_def = results[0][0]
            best = sorted(results[1:])[:4]
            print(f"{name} rows {rows}: bf16 cuBLAS {t_bf:6.1f} us | FP8 GEMV default "
                  f"{t_def:6.1f} ({gb / t_def * 1e3:.2f} TB/s) | best "
                  + ", ".join(f"{t:.1f} {c}" for t, c in best))  # fmt: skip
            table.append([rows, n, k, list(best[0][1])])
    if args.write_table:
        Path(args.write_table).write_text(json.dumps(table))
    if args.write_tc_table:
        Path(args.write_tc_table).write_text(json.dumps(tc_table))


if __name__ == "__main__":
    main()
