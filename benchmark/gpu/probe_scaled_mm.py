"""torch's block-scaled FP8 matmul (cuBLASLt, 1x128 activations x 128x128 weights) beside
our FP8 GEMV / W8A8 GEMM and bf16 cuBLAS, at Qwen3-8B's linear shapes, cold, in CUDA graphs:

    python benchmark/gpu/probe_scaled_mm.py [--rows 1 4 16 64 256 2048]

Checks each route (torch._scaled_mm inferring the recipes, torch.nn.functional.scaled_mm
naming them) against the dequantized reference first and times the ones that are right. A probe for issue 28: is the library's kernel the faster path?
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.gpu.bench_fp8 import fp8_copies  # noqa: E402
from benchmark.gpu.bench_gemv import L2_BYTES, SHAPES, graph_time_us, rotating  # noqa: E402
from minisgl.extensions.quantization.kernels import fp8_gemm, fp8_gemv  # noqa: E402

Route = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _legacy(xq: torch.Tensor, sa: torch.Tensor, q: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    # torch._scaled_mm infers the recipes from the scales' shapes (session 20: wrong results)
    return torch._scaled_mm(xq, q.t(), sa.t().contiguous().t(), sb.t(), out_dtype=torch.bfloat16)


def _explicit(
    xq: torch.Tensor, sa: torch.Tensor, q: torch.Tensor, sb: torch.Tensor
) -> torch.Tensor:
    # torch.nn.functional.scaled_mm (torch >= 2.10) with the recipes named, as torch's own
    # block-wise tests call it: a's scales outer-dim-major, b's the [K/128, N/128] view.
    f = torch.nn.functional
    return f.scaled_mm(xq, q.t(), sa.t().contiguous().t(), f.ScalingType.BlockWise1x128,
                       sb.t(), f.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)  # fmt: skip


ROUTES: dict[str, Route] = {"_scaled_mm (inferred)": _legacy}
if hasattr(torch.nn.functional, "scaled_mm"):
    ROUTES["F.scaled_mm (explicit recipes)"] = _explicit


def self_test() -> None:
    """torch's own block-wise test convention at a small shape: is this build's kernel right?"""
    m, n, k = 256, 768, 512
    x = torch.randn(m, k, device="cuda")
    y = torch.randn(n, k, device="cuda") * 1e-3
    xq, xs = fp8_gemm.quantize_groups(x)
    yb = y.view(n // 128, 128, k // 128, 128)
    ys = yb.abs().amax(dim=(1, 3)) / 448.0
    yq = (yb / ys[:, None, :, None]).view(n, k).to(torch.float8_e4m3fn)
    deq_x = (xq.float().view(m, -1, 128) * xs[..., None]).view(m, k)
    deq_y = (yq.float().view(n // 128, 128, k // 128, 128) * ys[:, None, :, None]).view(n, k)
    want = deq_x @ deq_y.T
    for label, route in ROUTES.items():
        try:
            got = route(xq, xs, yq, ys).float()
            err = float((got - want).abs().max() / want.abs().max())
            cos = float(torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0))
            print(f"self-test {label}: max rel err {err:.4f}, cosine {cos:.5f}", flush=True)
        except Exception as e:
            print(f"self-test {label}: {type(e).__name__}: {str(e)[:160]}", flush=True)


def probe_shape(name: str, rows_list: list[int]) -> None:
    n, k = SHAPES[name]
    copies = max(2, -(-2 * L2_BYTES // (n * k)))
    qs = fp8_copies(n, k, copies)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(-(-copies // 2))]
    gb = n * k / 1e9
    for rows in rows_list:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        q0, s0 = qs[0]
        xq, xs = fp8_gemm.quantize_groups(x)
        deq_x = (xq.float().view(rows, -1, 128) * xs[..., None]).view(rows, k)
        deq_w = (q0.float().view(n // 128, 128, k // 128, 128) * s0[:, None, :, None]).view(n, k)
        want = deq_x @ deq_w.T
        t_bf = graph_time_us(rotating(lambda w, x=x: x @ w.T, ws)) / len(ws)
        ours_fn = fp8_gemv.fp8_gemv if rows <= fp8_gemv.MAX_ROWS else fp8_gemm.fp8_gemm
        t_ours = graph_time_us(rotating(lambda q, x=x, f=ours_fn: f(x, *q), qs)) / copies
        line = f"{name} rows {rows}: bf16 {t_bf:7.1f} | ours {t_ours:7.1f} us"
        for label, route in ROUTES.items():
            try:
                got = route(xq, xs, q0, s0).float()
                err = float((got - want).abs().max() / want.abs().max())
                if err > 2e-2:
                    line += f" | {label}: WRONG ({err:.3f})"
                    continue
                run = rotating(lambda q, x=x, f=route: f(*fp8_gemm.quantize_groups(x), *q), qs)
                t = graph_time_us(run) / copies
                line += f" | {label}: {t:7.1f} us ({gb / t * 1e3:.2f} TB/s)"
            except Exception as e:  # a layout or row count the library refuses
                line += f" | {label}: {type(e).__name__}: {str(e)[:80]}"
        print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 2048])
    args = ap.parse_args()
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
    self_test()
    for name in ("8B qkv", "8B o", "8B gate_up", "8B down"):
        probe_shape(name, args.rows)


if __name__ == "__main__":
    main()
