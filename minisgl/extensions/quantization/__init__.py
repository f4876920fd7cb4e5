"""Quantized checkpoints, methods of minisgl/layers/quantization.py: 4-bit GPTQ and AWQ
(int4.py; kernels/ for CUDA), registered for ``quant_method`` gptq and awq; FP8 (fp8.py;
configs in fp8_config.py, MoE experts on kernels/fp8_moe.py), registered for fp8 and
compressed-tensors; and GGUF blocks kept quantized on CPU (gguf.py, csrc/gguf_cpu.c),
registered as ``gguf``.

Registering imports nothing heavy: the method's module (torch) is imported when a
checkpoint asks for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from minisgl.extensions.quantization.switches import (
    FP8_CUBLAS,
    FP8_FUSED_ACT,
    FP8_GEMV,
    FP8_KERNELS,
    FP8_MOE_KERNELS,
    INT4_GEMV,
)
from minisgl.layers.quantization import register_quant_method

if TYPE_CHECKING:
    from minisgl.layers.quantization import QuantMethod

__all__ = ["FP8_CUBLAS", "FP8_FUSED_ACT", "FP8_GEMV", "FP8_KERNELS", "FP8_MOE_KERNELS", "INT4_GEMV"]


def parse(config: Mapping[str, object]) -> QuantMethod:
    from minisgl.extensions.quantization.int4 import parse_int4

    return parse_int4(config)


def parse_gguf(config: Mapping[str, object]) -> QuantMethod:
    from minisgl.extensions.quantization.gguf import parse_gguf_method

    return parse_gguf_method(config)


def parse_fp8(config: Mapping[str, object]) -> QuantMethod:
    from minisgl.extensions.quantization import fp8_config

    if str(config.get("quant_method", "")).lower() == "fp8":
        return fp8_config.parse_fp8(config)
    return fp8_config.parse_compressed_tensors(config)


register_quant_method("gptq", parse)
register_quant_method("awq", parse)
register_quant_method("gguf", parse_gguf)
register_quant_method("fp8", parse_fp8)
register_quant_method("compressed-tensors", parse_fp8)
