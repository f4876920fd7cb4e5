"""Builds the optional AVX2 kernels of GGUF-quantized CPU products (csrc/gguf_cpu.c).

Everything else is configured in pyproject.toml. The extension is optional: where it cannot
be built (no C compiler, not x86-64), installation goes on and GGUF weights are dequantized
at load time instead (minisgl/extensions/quantization/gguf_cpu.py).
"""

import platform

from setuptools import Extension, setup

X86 = platform.machine().lower() in ("x86_64", "amd64")
ext_modules = (
    [
        Extension(
            "minisgl.extensions.quantization._gguf_cpu",
            sources=["csrc/gguf_cpu.c"],
            extra_compile_args=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]
    if X86
    else []
)
setup(ext_modules=ext_modules)
