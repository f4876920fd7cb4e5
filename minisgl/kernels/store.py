"""Triton kernel that scatters freshly computed K/V rows into the paged KV pool."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels import cdiv
from minisgl.kernels.pdl import pdl_args, pdl_wait

# Elements of one token's K (or V) row handled by one program; wider rows use more programs
# along grid axis 1, so any Hk * D works without huge register tiles.
_MAX_BLOCK = 1024


@triton.jit
def _round_fp8(x, LIMIT: tl.constexpr, SHIFT: tl.constexpr, MIN_NORMAL: tl.constexpr,
               BIG: tl.constexpr):  # fmt: skip
    """``x`` saturated to [-LIMIT, LIMIT] and rounded to nearest even onto the grid of an
    fp8 format whose mantissa is ``23 - SHIFT`` bits (as float32 values, so the cast that
    follows is exact). Rounding here rather than in the cast makes the result one and the
    same on the GPU and in Triton's interpreter (whose fp8 cast drops the rounding carry
    and does not saturate), and equal to kv_dtype.to_kv_dtype."""
    x = tl.minimum(tl.maximum(x.to(tl.float32), -LIMIT), LIMIT)
    bits = x.to(tl.int32, bitcast=True)
    # Normal range: round the float32 mantissa to the fp8 width on the bits (the carry
    # runs into the exponent; the sign bit is untouched since |x| <= LIMIT).
    keep = (bits >> SHIFT) & 1
    normal = (bits + ((1 << (SHIFT - 1)) - 1) + keep) & -(1 << SHIFT)
    # Below the smallest normal the fp8 grid is uniform: adding and subtracting BIG (whose
    # float32 ulp is that grid step) rounds to it; the sign bit is put back after.
    mag = tl.abs(x)
    sub = ((mag + BIG) - BIG).to(tl.int32, bitcast=True) | (bits & -2147483648)
    return tl.where(mag < MIN_NORMAL, sub, normal).to(tl.float32, bitcast=True)


@triton.jit
def cast_to_cache(x, ty: tl.constexpr):
    """``x`` as the KV cache's element type ``ty``: fp8 saturating, round to nearest even
    (scale 1.0, see kvcache/kv_dtype.py); any other type a plain cast."""
    if ty == tl.float8e4nv:  # e4m3fn: max 448, 3 mantissa bits, min normal 2^-6
        return _round_fp8(x, 448.0, 20, 0.015625, 16384.0).to(ty)
    elif ty == tl.float8e5:  # e5m2: max 57344, 2 mantissa bits, min normal 2^-14
        return _round_fp8(x, 57344.0, 21, 6.103515625e-05, 128.0).to(ty)
    else:
        return x.to(ty)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    stride_kt,
    stride_vt,
    stride_cache_slot,
    k_inv,
    v_inv,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    SCALED: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < ROW
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    dst = slot * stride_cache_slot + offs
    k = tl.load(k_ptr + tok * stride_kt + offs, mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + offs, mask=mask)
    if SCALED:  # an fp8 cache's per-tensor scales: the cache holds value / scale
        k, v = k.to(tl.float32) * k_inv, v.to(tl.float32) * v_inv
    # Cast in-kernel so a bf16 model can write an fp16/fp32/fp8 pool in one pass.
    tl.store(k_cache_ptr + dst, cast_to_cache(k, k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, cast_to_cache(v, v_cache_ptr.dtype.element_ty), mask=mask)


def _flat_rows(x: torch.Tensor) -> torch.Tensor:
    """Return ``x`` [T, H, D] with each token's H*D elements contiguous (views of a fused
    QKV projection already are; only then is the kernel's flat row addressing valid)."""
    _, h, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d:
        x = x.contiguous()
    return x


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``k``/``v`` [T, Hk, D] into ``k_cache``/``v_cache`` [num_slots, Hk, D] at ``slots``;
    the cache holds ``k / k_scale`` and ``v / v_scale`` (an fp8 cache's scales)."""
    num_tokens, hk, d = k.shape
    if num_tokens == 0:
        return
    assert v.shape == k.shape and slots.shape == (num_tokens,)
    assert k_cache.shape[1:] == (hk, d) and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(2) == 1 and k_cache.stride(1) == d
    k, v = _flat_rows(k), _flat_rows(v)
    row = hk * d
    block = min(triton.next_power_of_2(row), _MAX_BLOCK)
    grid = (num_tokens, cdiv(row, block))
    _store_kv_kernel[grid](
        k,
        v,
        k_cache,
        v_cache,
        slots,
        k.stride(0),
        v.stride(0),
        k_cache.stride(0),
        1.0 / k_scale,
        1.0 / v_scale,
        ROW=row,
        BLOCK=block,
        SCALED=(k_scale, v_scale) != (1.0, 1.0),
        num_warps=4,
        **pdl_args(),
    )
