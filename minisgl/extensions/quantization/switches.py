"""The extension's environment switch (declared through minisgl/env.py's registry)."""

from __future__ import annotations

from minisgl.env import flag

INT4_GEMV = flag("INT4_GEMV", True, "CUDA: 1-4-row int4 products on the int4 GEMV")
GGUF_KERNELS = flag(
    "GGUF_KERNELS", True, "CPU: GGUF weights stay quantized (AVX2 kernels); off: dequantized"
)
FP8_KERNELS = flag(
    "FP8_KERNELS", True, "CUDA: FP8 dense layers and experts keep e4m3 weights; off: bf16"
)
FP8_GEMV = flag("FP8_GEMV", True, "CUDA: 1-4-row FP8 products on the FP8 GEMV; off: the GEMM")
FP8_FUSED_ACT = flag(
    "FP8_FUSED_ACT",
    True,
    "CUDA: W8A8 FP8 products quantize their activations in the kernel before them (SiLU-and-"
    "mul, RMSNorm; the same bits); off: those kernels, then the quantizer, on their own",
)
FP8_CUBLAS = flag(
    "FP8_CUBLAS",
    True,
    "CUDA: FP8 products of 128x128-block weights beyond the GEMV's rows on cuBLASLt's "
    "block-scaled GEMM where torch and CUDA provide it; off: kernels/fp8_gemm.py",
)
FP8_MOE_KERNELS = flag(
    "FP8_MOE_KERNELS",
    True,
    "CUDA: FP8 MoE experts keep e4m3 weights for the FP8 fused MoE (with FP8_KERNELS); off: "
    "dequantized to bf16 at load",
)
