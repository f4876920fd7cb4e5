"""torch's block-scaled FP8 matmul (cuBLASLt, 1x128 activations x 128x128 weights) beside
our FP8 GEMV / W8A8 GEMM and bf16 cuBLAS, at Qwen3-8B's linear shapes, cold, in CUDA graphs:

    python benchmark/gpu/probe_scaled_mm.py [--rows 1 4 16 64 256 2048]

Checks each scale layout torch may want against the dequantized reference first and times
the ones that are right. A probe for issue 28: is the library's kernel the faster path?
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

Layout = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
LAYOUTS: dict[str, Layout] = {
    # (activation scales [M, K/128], weight scales [N/128, K/128]) -> what _scaled_mm takes
    "a M-major, b K/128 x N/128 view": lambda sa, sb: (sa.t().contiguous().t(), sb.t()),
    "a M-major, b contiguous K/128 x N/128": lambda sa, sb: (
        sa.t().contiguous().t(),
        sb.t().contiguous(),
    ),
    "a row-major, b view": lambda sa, sb: (sa, sb.t()),
    # Diagnostics (session 19: the first layout ran but fp8_cuda's probe rejected its result):
    # which scale cuBLAS misreads shows in how far each of these lands from the reference.
    "a ones": lambda sa, sb: (torch.ones_like(sa).t().contiguous().t(), sb.t()),
    "b ones": lambda sa, sb: (sa.t().contiguous().t(), torch.ones_like(sb).t()),
    "reciprocals": lambda sa, sb: ((1 / sa).t().contiguous().t(), (1 / sb).t()),
}


def scaled_mm(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, layout: Layout) -> torch.Tensor:
    xq, xs = fp8_gemm.quantize_groups(x)
    sa, sb = layout(xs, s)
    return torch._scaled_mm(xq, q.t(), sa, sb, out_dtype=torch.bfloat16)


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
        for label, layout in LAYOUTS.items():
            try:
                got = scaled_mm(x, q0, s0, layout).float()
                err = float((got - want).abs().max() / want.abs().max())
                if err > 2e-2:
                    line += f" | {label}: WRONG ({err:.3f})"
                    continue
                run = rotating(lambda q, x=x, lay=layout: scaled_mm(x, *q, lay), qs)
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
    for name in ("8B qkv", "8B o", "8B gate_up", "8B down"):
        probe_shape(name, args.rows)


if __name__ == "__main__":
    main()
