"""FP8 products on the H200 at Qwen3-8B's linear shapes (block scales 128 x 128), cold (each
call reads the next of several weight copies, together twice the L2), in CUDA graphs:

    python benchmark/gpu/bench_fp8.py [--rows 1 2 4] [--gemm-rows 16 64 256 2048]
        [--write-table fp8_gemv.json]
    python benchmark/offline/bench_latency.py --fp8-gemv-table fp8_gemv.json ...

The FP8 GEMV (kernels/fp8_gemv.py) at its default tiles and a grid of others, against bf16
cuBLAS; the W8A8 GEMM (kernels/fp8_gemm.py, activation quantization included) against bf16
cuBLAS at larger row counts, and cuBLASLt's block-scaled FP8 GEMM (torch._scaled_mm) beside it
where this torch and CUDA run it. --write-table keeps the fastest GEMV tiles per shape and rows.
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
from minisgl.extensions.quantization.fp8_cuda import cublas_block_gemm_runs  # noqa: E402
from minisgl.extensions.quantization.kernels import fp8_gemm, fp8_gemv  # noqa: E402

SIZES = [(8, 1024, 4), (4, 2048, 4), (8, 2048, 8), (16, 1024, 8), (4, 1024, 4), (8, 512, 4),
         (16, 1024, 4), (16, 2048, 8), (32, 1024, 8)]  # fmt: skip
# (BLOCK_N, BLOCK_K, warps, stages, PREFETCH, R, FLAT); R = 1 only at <= 64 accumulators a
# thread; FLAT (one row's products in the weights' layout) at one row only.
GRID = [(bn, bk, w, 1, p, r, f)
        for (bn, bk, w), p, r, f in itertools.product(SIZES, (0, 1), (1, 16), (0, 1))
        if r > 1 or bn * bk <= 64 * 32 * w]  # fmt: skip

# The W8A8 GEMM on 64-row tiles (e4m3 wgmma) at the GEMV's row counts (--gemm-few).
GEMM_QGMMA_GRID = [(64, bn, 4, st) for bn in (16, 32, 64) for st in (3, 5)]
# Its tiles from 256 rows (--gemm-sweep): (BLOCK_M, BLOCK_N, warps, stages).
GEMM_LARGE_GRID = [(64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 4, 3), (128, 128, 8, 3),
                   (128, 128, 8, 4), (128, 256, 8, 3), (64, 256, 4, 3), (256, 128, 8, 3)]  # fmt: skip


def gemm_few_rows(name: str, x: torch.Tensor, qs: list[tuple[torch.Tensor, torch.Tensor]],
                  gb: float) -> None:  # fmt: skip
    """The W8A8 GEMM (its activation quantizer included) at GEMM_QGMMA_GRID, for the GEMV's
    1-4 rows and GEMM row counts up to 64 (its default tiles there are 16 or 32 rows, which
    Triton runs on mma.sync with both e4m3 operands unpacked to float16)."""
    results = []
    for tiles in GEMM_QGMMA_GRID:
        run = rotating(lambda q, x=x, t=tiles: fp8_gemm.fp8_gemm(x, *q, tiles=t), qs)
        results.append((graph_time_us(run) / len(qs), tiles))
    best = sorted(results)[:3]
    print(f"{name} rows {x.shape[0]}: W8A8 GEMM 64-row tiles "
          + ", ".join(f"{t:.1f} ({gb / t * 1e3:.2f} TB/s) {c}" for t, c in best), flush=True)  # fmt: skip


def gemm_tiles_column(x: torch.Tensor, qs: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """The Triton GEMM's three fastest tiles of GEMM_LARGE_GRID."""
    results = []
    for tiles in GEMM_LARGE_GRID:
        try:
            run = rotating(lambda q, t=tiles: fp8_gemm.fp8_gemm(x, *q, tiles=t), qs)
            results.append((graph_time_us(run) / len(qs), tiles))
        except Exception as e:  # a tile Triton cannot compile (shared memory)
            print(f"  {tiles}: {type(e).__name__}")
    return ", tiles " + ", ".join(f"{t:.1f} {c}" for t, c in sorted(results)[:3])


def cublas_column(x: torch.Tensor, qs: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """cuBLASLt's block-scaled FP8 GEMM (its activation quantizer included), checked against
    the Triton GEMM's result on the same operands."""
    if not cublas_block_gemm_runs(x.device):
        return ""
    got = fp8_gemm.cublas_fp8_gemm(x, *qs[0]).float()
    want = fp8_gemm.fp8_gemm(x, *qs[0]).float()
    err = ((got - want).abs().max() / want.abs().max()).item()
    t = graph_time_us(rotating(lambda q: fp8_gemm.cublas_fp8_gemm(x, *q), qs)) / len(qs)
    return f", cuBLASLt block FP8 {t:7.1f} (max diff {err:.1e} of max)"


def silu_column(rows: int, k: int, qs: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """The down projection from the gated MLP's [gate | up]: SiLU-and-mul's own kernel, then
    the product, against the product computing it on the way in (``silu_x``)."""
    from minisgl.kernels.activation import silu_and_mul

    gu = torch.randn(rows, 2 * k, device="cuda", dtype=torch.bfloat16)
    fn = fp8_gemv.fp8_gemv if rows <= fp8_gemv.MAX_ROWS else fp8_gemm.fp8_gemm
    try:
        same = torch.equal(fn(silu_and_mul(gu), *qs[0]), fn(gu, *qs[0], silu_x=True))
        two = graph_time_us(rotating(lambda q: fn(silu_and_mul(gu), *q), qs)) / len(qs)
        fused = graph_time_us(rotating(lambda q: fn(gu, *q, silu_x=True), qs)) / len(qs)
    except Exception as e:  # keep the rest of the run
        return f" | silu: {type(e).__name__}: {e}"[:200]
    return f" | silu-mul + product {two:.1f} us, fused {fused:.1f} us (same bits: {same})"


def fp8_copies(n: int, k: int, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(n + k)
    out = []
    for _ in range(copies):
        q = (torch.randn(n, k, device="cuda", generator=g) * 64).to(torch.float8_e4m3fn)
        out.append((q, torch.rand(n // 128, k // 128, device="cuda", generator=g) * 1e-3))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="*", default=[1])
    ap.add_argument("--gemm-rows", type=int, nargs="*", default=[16, 64, 256, 2048])
    ap.add_argument("--write-table", default=None)
    ap.add_argument("--gemm-few", action="store_true", help="the GEMM's 64-row tiles at <= 64 rows")
    ap.add_argument("--gemm-sweep", action="store_true", help="the GEMM's tiles from 256 rows")
    ap.add_argument("--no-sweep", action="store_true", help="the GEMV at its default tiles only")
    ap.add_argument("--silu", action="store_true", help="down: SiLU-and-mul fused on the way in")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuBLASLt block-scaled FP8: "
          f"{cublas_block_gemm_runs(torch.device('cuda', torch.cuda.current_device()))}")  # fmt: skip
    table: list[list[object]] = []
    for name in ("8B qkv", "8B o", "8B gate_up", "8B down"):
        n, k = SHAPES[name]
        copies = max(2, -(-2 * L2_BYTES // (n * k)))
        qs = fp8_copies(n, k, copies)
        ws = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(-(-copies // 2))
        ]
        gb = n * k / 1e9  # bytes of e4m3 weights, in GB
        few = args.rows + [r for r in args.gemm_rows if r <= 64]
        for rows in few if args.gemm_few else []:
            gemm_few_rows(name, torch.randn(rows, k, device="cuda", dtype=torch.bfloat16), qs, gb)
        for rows in args.rows + args.gemm_rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            t_bf = graph_time_us(rotating(lambda w, x=x: x @ w.T, ws)) / len(ws)
            if rows > fp8_gemv.MAX_ROWS:
                t = graph_time_us(rotating(lambda q, x=x: fp8_gemm.fp8_gemm(x, *q), qs)) / copies
                print(f"{name} rows {rows}: GEMM {t:7.1f} us vs bf16 cuBLAS {t_bf:7.1f}"
                      + cublas_column(x, qs)
                      + (gemm_tiles_column(x, qs) if args.gemm_sweep and rows >= 256 else "")
                      + (silu_column(rows, k, qs) if args.silu and name == "8B down" else ""),
                      flush=True)  # fmt: skip
                continue
            results = []
            want = fp8_gemv.fp8_gemv(x, *qs[0]).float()
            for cfg in [None, *([] if args.no_sweep else GRID)]:
                if cfg is not None and cfg[-1] and rows > 1:
                    continue  # FLAT runs at one row only
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
                  + ", ".join(f"{t:.1f} {c}" for t, c in best)
                  + (silu_column(rows, k, qs) if args.silu and name == "8B down" else ""))  # fmt: skip
            if best:
                table.append([rows, n, k, list(best[0][1])])
    if args.write_table:
        Path(args.write_table).write_text(json.dumps(table))


if __name__ == "__main__":
    main()
