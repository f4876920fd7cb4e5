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
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    stride_kt,
    stride_vt,
    stride_cache_slot,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
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
    # Cast in-kernel so a bf16 model can write an fp16/fp32 pool (and vice versa) in one pass.
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


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
) -> None:
    """Write ``k``/``v`` [T, Hk, D] into ``k_cache``/``v_cache`` [num_slots, Hk, D] at ``slots``."""
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
        ROW=row,
        BLOCK=block,
        num_warps=4,
        **pdl_args(),
    )
