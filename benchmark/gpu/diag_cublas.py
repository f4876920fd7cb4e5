"""cuBLASLt's block-scaled FP8 GEMM (fp8_gemm.cublas_fp8_gemm) against the Triton W8A8 GEMM
on the same operands at a few row counts, each failure's traceback tail, then the engine's
load-time probe (fp8_cuda.cublas_block_gemm_runs): python benchmark/gpu/diag_cublas.py"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from minisgl.extensions.quantization.fp8_cuda import cublas_block_gemm_runs  # noqa: E402
from minisgl.extensions.quantization.kernels import fp8_gemm  # noqa: E402

SHAPES = ((40, 256, 512), (36, 384, 1024), (37, 384, 1024), (8, 4096, 4096), (2048, 4096, 4096))


def main() -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    for m, n, k in SHAPES:
        x = torch.randn(m, k, device=dev, generator=g).bfloat16()
        w = torch.randn(n, k, device=dev, generator=g).to(torch.float8_e4m3fn)
        s = torch.rand(n // 128, k // 128, device=dev, generator=g) + 0.5
        try:
            got = fp8_gemm.cublas_fp8_gemm(x, w, s).float()
        except Exception:
            print(m, n, k, "raised:", traceback.format_exc()[-400:])
            continue
        want = fp8_gemm.fp8_gemm(x, w, s).float()
        err = ((got - want).abs().max() / want.abs().max()).item()
        print(m, n, k, f"max difference {err:.2e} of the largest output")
    print("engine probe:", cublas_block_gemm_runs(dev))


if __name__ == "__main__":
    main()
