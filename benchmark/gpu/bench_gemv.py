"""Skinny GEMM on the H200: cuBLAS (F.linear) vs the Triton GEMV (kernels/gemv.py) on the
linear layers of Qwen3-0.6B and Qwen3-8B, timed inside CUDA graphs (as decode runs them: a
Triton launch costs 30-60 us of host time, more than these kernels take on the GPU).

    python benchmark/gpu/bench_gemv.py [--rows 1 2 4] [--cold] [--shapes 8B]
        [--write-table table.json]
    python benchmark/gpu/bench_gemv.py --int4 [--int4-sweep] [--rows 1 2 4] [--shapes 8B]
    python benchmark/offline/bench_latency.py --gemv-table table.json ...

--write-table keeps, per shape and row count, the fastest tiles where they beat cuBLAS by
at least 3%, else null (cuBLAS): the table bench_latency.py --gemv-table loads.

--cold: each timed call reads the next of several copies of the weight, together at least
twice the H200's 60 MB L2, as a decode step does (36 layers' weights pass between two reads
of one layer's). Without it, weights under ~50 MB stay in L2 across replays and both sides
look faster than they run in the engine.

--int4 [--int4-sweep]: 4-bit weights (group 128, the layout of kernels/int4_gemm.py) at the
8B shapes (or --shapes), cold: the int4 GEMV (kernels/int4_gemv.py, default tiles) against
the int4 GEMM and bf16 cuBLAS, in CUDA graphs, the GEMV at its default tiles; --int4-sweep
also times a grid of GEMV tiles (about 20 a row count) and prints the best 4 (the input for int4_gemv_tiles).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
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
    # One rank's shards at TP=2 (column-parallel outputs and row-parallel inputs halved).
    "8B-tp2 qkv": (3072, 4096),
    "8B-tp2 o": (4096, 2048),
    "8B-tp2 gate_up": (12288, 4096),
    "8B-tp2 down": (4096, 6144),
    "8B-tp2 lm_head": (75968, 4096),
}


def graph_time_us(fn: Callable[[], object]) -> float:
    import triton.testing

    fn()  # compile outside the capture
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=30)) * 1e3


L2_BYTES = 60 * 2**20


def weight_copies(n: int, k: int, cold: bool) -> list[torch.Tensor]:
    """One weight, or with ``cold`` enough copies to pass twice the L2 between two reads."""
    copies = max(2, -(-2 * L2_BYTES // (n * k * 2))) if cold else 1
    g = torch.Generator(device="cuda").manual_seed(n + k)
    return [
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
        for _ in range(copies)
    ]


def rotating(fn: Callable[[torch.Tensor], object], ws: list[torch.Tensor]) -> Callable[[], None]:
    """A callable that runs ``fn`` on each copy in turn: one graph replays them all, and
    the time per call is the graph's time divided by the copies (see graph_time_us)."""

    def run() -> None:
        for w in ws:
            fn(w)

    return run


INT4_GROUP = 128


def int4_copies(n: int, k: int, cold: bool) -> list[tuple[torch.Tensor, ...]]:
    """Random int4 weights (qweight, scales, zeros) in the kernels' layout; with ``cold``
    enough copies to pass twice the L2 between two reads (as weight_copies)."""
    nbytes = n * k // 2 + (k // INT4_GROUP) * n * 5
    copies = max(2, -(-2 * L2_BYTES // nbytes)) if cold else 1
    g = torch.Generator(device="cuda").manual_seed(n + k)
    out = []
    for _ in range(copies):
        qw = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), device="cuda", generator=g)
        scales = torch.rand(k // INT4_GROUP, n, device="cuda", generator=g) * 0.02 / k**0.5
        zeros = torch.randint(0, 16, (k // INT4_GROUP, n), device="cuda", generator=g)
        out.append((qw.to(torch.int32), scales, zeros.to(torch.uint8)))
    return out


def main_int4(rows_list: list[int], shapes: dict[str, tuple[int, int]], sweep: bool) -> None:
    from minisgl.extensions.quantization.kernels.int4_gemm import int4_gemm
    from minisgl.extensions.quantization.kernels.int4_gemv import int4_gemv, int4_gemv_tiles

    bf = torch.bfloat16
    for name, (n, k) in shapes.items():
        qs = int4_copies(n, k, cold=True)
        ws = weight_copies(n, k, cold=True)
        gb4 = (n * k // 2 + (k // INT4_GROUP) * n * 5) / 1e9  # words, scales and zeros
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=bf)
            q0 = qs[0]
            ref = int4_gemm(x, *q0, INT4_GROUP)
            got = int4_gemv(x, *q0, INT4_GROUP)
            torch.testing.assert_close(got, ref, atol=5e-2, rtol=2e-2)

            def gemm(q: tuple, x: torch.Tensor = x) -> object:
                return int4_gemm(x, *q, INT4_GROUP)

            def cublas(w: torch.Tensor, x: torch.Tensor = x) -> object:
                return torch.nn.functional.linear(x, w)

            t_gemm = graph_time_us(rotating(gemm, qs)) / len(qs)  # type: ignore[arg-type]
            t_cublas = graph_time_us(rotating(cublas, ws)) / len(ws)
            configs = [int4_gemv_tiles(rows, n, k)]  # the default first
            if sweep:  # tiles of 4-32 words a thread, BLOCK_K <= 128 x warps (int4_gemv)
                bm = configs[0][0]
                configs += [
                    (bm, bn, bk, wp, 1)
                    for bn, bk, wp in itertools.product(
                        (8, 16, 32, 64, 128), (128, 256, 512, 1024), (2, 4, 8)
                    )
                    if bk <= 128 * wp and 4 <= bk // 8 * bn // (32 * wp) <= (32 // bm or 8)
                ]
            results = []
            for cfg in dict.fromkeys(configs):

                def ours(q: tuple, c: tuple = cfg, x: torch.Tensor = x) -> object:
                    return int4_gemv(x, *q, INT4_GROUP, None, c)

                try:
                    t = graph_time_us(rotating(ours, qs)) / len(qs)  # type: ignore[arg-type]
                except Exception as e:  # out of registers or shared memory for this tile
                    print(f"  {name} {cfg}: {type(e).__name__}")
                    continue
                results.append((t, cfg))
            t_def = next((t for t, c in results if c == configs[0]), float("nan"))
            top = ", ".join(f"{c[1:]} {t:.1f}" for t, c in sorted(results)[:4])
            print(
                f"{name:13s} M={rows}: bf16 cuBLAS {t_cublas:6.1f} us | int4 GEMM {t_gemm:6.1f}"
                f" | GEMV default {t_def:6.1f} ({gb4 / t_def * 1e3:.2f} TB/s)"
                + (f" | best {top}" if sweep else ""),
                flush=True,
            )


def main() -> None:
    from minisgl.kernels.gemv import gemv, gemv_choice, gemv_tiles

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--shapes", default="", help="only shapes whose name contains this")
    ap.add_argument("--write-table", default=None)
    ap.add_argument("--flat-sweep", action="store_true", help="one row: FLAT tiles only, weights "
                    "the rule gives the GEMV (<= 64M values)")  # fmt: skip
    ap.add_argument("--int4", action="store_true", help="int4 GEMV vs GEMM vs bf16 cuBLAS")
    ap.add_argument("--int4-sweep", action="store_true", help="with --int4: sweep GEMV tiles")
    args = ap.parse_args()
    if args.int4:
        pattern = args.shapes or "8B "
        # The LM head stays float in int4 checkpoints.
        shapes = {k: v for k, v in SHAPES.items() if pattern in k and "lm_head" not in k}
        main_int4(args.rows, shapes, args.int4_sweep)
        return
    bf = torch.bfloat16
    table = []
    shapes = {k: v for k, v in SHAPES.items() if args.shapes in k}
    if args.flat_sweep:
        args.rows = [1]
        shapes = {k: (n, kk) for k, (n, kk) in shapes.items() if n * kk <= 64 * 2**20}
    for name, (n, k) in shapes.items():
        ws = weight_copies(n, k, args.cold)
        per = len(ws)
        gb = n * k * 2 / 1e9
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=bf)
            w0 = ws[0]
            ref = torch.nn.functional.linear(x, w0)
            got = gemv(x, w0)

            def base(w: torch.Tensor, x: torch.Tensor = x) -> object:
                return torch.nn.functional.linear(x, w)

            torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
            t_cublas = graph_time_us(rotating(base, ws)) / per
            bm = gemv_tiles(rows)[0]
            limit = 16384
            grid = (
                itertools.product((4, 8, 16), (1024, 2048), (4, 8), (1, 3), (1,))
                if args.flat_sweep
                else itertools.product(
                    (2, 4, 8, 16), (256, 512, 1024, 2048), (4, 8), (3, 4), (0, 1)
                )
            )
            configs = [gemv_choice(rows, n, k) or gemv_tiles(rows)] + [
                (bm, bn, bk, wp, st, flat)  # FLAT: one row's products in 2-D (kernels/gemv.py)
                for bn, bk, wp, st, flat in grid
                if bm * bn * bk <= limit and (rows == 1 or not flat)
            ]
            results = []
            for cfg in dict.fromkeys(configs):

                def ours(w: torch.Tensor, c: tuple = cfg, x: torch.Tensor = x) -> object:
                    return gemv(x, w, None, c)  # type: ignore[arg-type]

                try:
                    t = graph_time_us(rotating(ours, ws)) / per
                except Exception as e:  # out of registers or shared memory for this tile
                    print(f"  {name} {cfg}: {type(e).__name__}")
                    continue
                results.append((t, cfg))
            t_default = results[0][0]
            results.sort()
            best_t, best_c = results[0]
            top = ", ".join(f"{c[1:]} {t:.1f}" for t, c in results[:4])
            print(
                f"{name:13s} M={rows}: cuBLAS {t_cublas:6.1f} us ({gb / t_cublas * 1e3:.2f} TB/s)"
                f" | default {t_default:6.1f} | best {best_t:6.1f} us ({gb / best_t * 1e3:.2f})"
                f" | top {top}",
                flush=True,
            )
            table.append([rows, n, k, list(best_c) if best_t < 0.97 * t_cublas else None])
            if args.write_table:  # after every shape: a cut run keeps what it measured
                Path(args.write_table).write_text(json.dumps(table))


if __name__ == "__main__":
    main()
