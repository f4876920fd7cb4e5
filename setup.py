"""Builds the optional AVX2 CPU kernels of csrc/cpu_kernels.c (GGUF-quantized products, fused
RMSNorm, RoPE and decode attention; cpu_stack.c, the decode stack; cpu_tile.c, AVX-512 float32
tiles for products of many rows, chosen at run time) as minisgl.kernels._cpu.

Everything else is configured in pyproject.toml. The extension is optional: where it cannot
be built (no C compiler, not x86-64), installation goes on and the CPU path runs on torch's
own kernels, with GGUF weights dequantized at load time (minisgl/kernels/cpu.py).
"""

import platform

from setuptools import Extension, setup

X86 = platform.machine().lower() in ("x86_64", "amd64")
ext_modules = (
    [
        Extension(
            "minisgl.kernels._cpu",
            sources=["csrc/cpu_kernels.c", "csrc/cpu_stack.c", "csrc/cpu_tile.c"],
            depends=["csrc/cpu_kernels.h"],
            extra_compile_args=[
                "-O3",
                "-mavx2",
                "-mfma",
                "-mf16c",
                "-fopenmp",
                "-ffp-contract=off",
                "-fvisibility=hidden",
            ],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]
    if X86
    else []
)
setup(ext_modules=ext_modules)
