"""The extension's environment switch (declared through minisgl/env.py's registry)."""

from __future__ import annotations

from minisgl.env import flag

INT4_GEMV = flag("INT4_GEMV", True, "CUDA: 1-4-row int4 products on the int4 GEMV")
GGUF_KERNELS = flag(
    "GGUF_KERNELS", True, "CPU: GGUF weights stay quantized (AVX2 kernels); off: dequantized"
)
