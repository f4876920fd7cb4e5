"""KV-cache element types (``--kv-cache-dtype``) and how values are stored in them.

``auto`` keeps K/V in the model's dtype. ``fp8_e4m3`` (alias ``fp8``, as vLLM) and
``fp8_e5m2`` store one byte per element, so the same memory holds twice the tokens of a
bf16 pool. The scale is per tensor and per layer: 1.0 (as SGLang without calibration files),
or a checkpoint's ``k_scale`` / ``v_scale`` where it has them (kv_scales.py). A store divides
by the scale (multiplies by its inverse), saturates at the format's finite max and rounds to
nearest even; a read upcasts and multiplies back (the Triton kernels fold that into the
softmax scale and the output: kernels/fp8_kv.py).
"""

from __future__ import annotations

import torch

from minisgl.config import KV_CACHE_DTYPES

_FP8 = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
assert set(KV_CACHE_DTYPES) == {"auto", *_FP8}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for ``--kv-cache-dtype name`` under a model in ``model_dtype``."""
    if name == "auto":
        return model_dtype
    if name not in _FP8:
        raise ValueError(f"kv_cache_dtype={name!r} is invalid: one of {', '.join(KV_CACHE_DTYPES)}")
    return _FP8[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def to_kv_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the pool's ``dtype``. fp8 saturates: a plain cast turns values past the
    finite max into NaN (e4m3fn) or inf (e5m2), which would poison every later softmax.
    The bounds (448, 57344) are exact in bf16/fp16/fp32, so clamping in x's dtype equals
    clamping in fp32, and torch casts to fp8 with one round-to-nearest-even from there."""
    if not is_fp8(dtype):
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)
