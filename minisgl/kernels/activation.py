"""Fused SiLU-and-multiply for gated MLPs: [T, 2I] -> silu(x[:, :I]) * x[:, I:]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels import cdiv
from minisgl.kernels.pdl import pdl_args, pdl_wait

# Columns per program; wider intermediate sizes spread over grid axis 1.
_MAX_BLOCK = 1024


@triton.jit
def silu_mul(gate, up, dtype: tl.constexpr):
    """silu(gate) * up in ``dtype`` with the torch reference's two roundings: silu(gate) is
    rounded to ``dtype`` before the multiply. x / (1 + exp(-x)) is torch's own formula for
    silu. Every kernel that takes a gated MLP's [gate | up] computes it here (the same bits)."""
    gate = gate.to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(dtype)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, inter, stride_xt, stride_ot, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    pdl_wait(PDL)
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = x_ptr.dtype.element_ty
    row = x_ptr + tok * stride_xt
    gate = tl.load(row + cols, mask=mask, other=0.0)
    up = tl.load(row + inter + cols, mask=mask, other=0.0)
    tl.store(out_ptr + tok * stride_ot + cols, silu_mul(gate, up, dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., 2I] -> silu(x[..., :I]) * x[..., I:] as a new contiguous [..., I] tensor."""
    two_i = x.shape[-1]
    assert two_i % 2 == 0, f"last dim must be even, got {two_i}"
    inter = two_i // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    x2 = x2.reshape(-1, two_i)  # a view for the usual contiguous [T, 2I] input
    out2 = out.view(-1, inter)
    block = min(triton.next_power_of_2(inter), _MAX_BLOCK)
    grid = (x2.shape[0], cdiv(inter, block))
    _silu_and_mul_kernel[grid](
        x2, out2, inter, x2.stride(0), out2.stride(0), BLOCK=block, **pdl_args()
    )
    return out
