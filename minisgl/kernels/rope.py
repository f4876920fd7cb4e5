"""Rotary position embedding in Triton, rotate-half layout (Hugging Face / GGUF-as-loaded).

For x = [x1, x2] (halves of head_dim) and the cos/sin rows of the token's position:
    out1 = x1 * cos1 - x2 * sin1,   out2 = x2 * cos2 + x1 * sin2
The reference (``RotaryEmbedding.forward``) casts cos/sin to the activation dtype and rounds
after each product and after the sum; the kernel computes in float32 but rounds at those
same points, so half-precision results equal the reference's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.pdl import pdl_args, pdl_wait

# Elements of one [heads, half] tile; more heads than fit are handled in a loop.
_TILE = 2048


@triton.jit
def load_cos_sin(
    cos_ptr, sin_ptr, pos, stride_cos, stride_sin, offs_d, d_mask,
    HALF: tl.constexpr, dtype: tl.constexpr,
):  # fmt: skip
    """Both halves of position ``pos``'s cos/sin rows (not assumed equal, so any table
    layout gives the reference result), cast to the activation dtype as the reference does."""
    cos_row = cos_ptr + pos * stride_cos + offs_d
    sin_row = sin_ptr + pos * stride_sin + offs_d
    c1 = tl.load(cos_row, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    c2 = tl.load(cos_row + HALF, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    s1 = tl.load(sin_row, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    s2 = tl.load(sin_row + HALF, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def rotate_halves(x1, x2, c1, c2, s1, s2, dtype: tl.constexpr):
    """Rotated halves [H, HALF] of rows whose halves are x1, x2 (float32): each product,
    then the sum, rounded to the activation dtype, the reference's order."""
    a1 = (x1 * c1[None, :]).to(dtype).to(tl.float32)
    b1 = (-x2 * s1[None, :]).to(dtype).to(tl.float32)
    a2 = (x2 * c2[None, :]).to(dtype).to(tl.float32)
    b2 = (x1 * s2[None, :]).to(dtype).to(tl.float32)
    return (a1 + b1).to(dtype), (a2 + b2).to(dtype)


@triton.jit
def _rotate_heads(
    src_ptr, dst_ptr, stride_src_h, stride_dst_h, c1, c2, s1, s2, offs_d, d_mask,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    dtype = src_ptr.dtype.element_ty
    for h0 in range(0, NUM_HEADS, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = (offs_h < NUM_HEADS)[:, None] & d_mask[None, :]
        src = src_ptr + offs_h[:, None] * stride_src_h + offs_d[None, :]
        dst = dst_ptr + offs_h[:, None] * stride_dst_h + offs_d[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        y1, y2 = rotate_halves(x1, x2, c1, c2, s1, s2, dtype)
        tl.store(dst, y1, mask=mask)
        tl.store(dst + HALF, y2, mask=mask)


@triton.jit
def _rope_kernel(
    pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cos, stride_sin,
    HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(PDL)
    # One program per token: its cos/sin row is read once and reused for every q and k head.
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HALF
    dtype = q_ptr.dtype.element_ty
    c1, c2, s1, s2 = load_cos_sin(
        cos_ptr, sin_ptr, pos, stride_cos, stride_sin, offs_d, d_mask, HALF, dtype
    )
    _rotate_heads(
        q_ptr + tok * stride_qt, q_out_ptr + tok * stride_qot, stride_qh, stride_qoh,
        c1, c2, s1, s2, offs_d, d_mask, HQ, HALF, BLOCK_HQ,
    )  # fmt: skip
    _rotate_heads(
        k_ptr + tok * stride_kt, k_out_ptr + tok * stride_kot, stride_kh, stride_koh,
        c1, c2, s1, s2, offs_d, d_mask, HK, HALF, BLOCK_HK,
    )  # fmt: skip


def _head_block(heads: int, block_d: int) -> int:
    return max(1, min(triton.next_power_of_2(heads), _TILE // block_d))


def apply_rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` [T, Hq, D] and ``k`` [T, Hk, D] by the ``cos``/``sin`` rows [max_pos, D]
    of ``positions`` [T]. Returns new contiguous tensors, or ``q``/``k`` themselves when
    ``inplace`` (they may be strided views, e.g. slices of a fused QKV output)."""
    assert q.dim() == 3 and k.dim() == 3, (q.shape, k.shape)
    num_tokens, hq, d = q.shape
    assert k.shape[0] == num_tokens and k.shape[2] == d and k.dtype == q.dtype
    assert d % 2 == 0, f"head_dim must be even, got {d}"
    assert positions.shape == (num_tokens,), (positions.shape, num_tokens)
    assert cos.dim() == 2 and cos.shape[1] == d and sin.shape == cos.shape
    assert cos.stride(1) == 1 and sin.stride(1) == 1
    assert positions.device == q.device == k.device == cos.device == sin.device
    if inplace:
        assert q.stride(2) == 1 and k.stride(2) == 1, "in-place needs unit last stride"
        q_out, k_out = q, k
    else:
        if q.stride(2) != 1:
            q = q.contiguous()
        if k.stride(2) != 1:
            k = k.contiguous()
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = d // 2
    block_d = triton.next_power_of_2(half)
    _rope_kernel[(num_tokens,)](
        positions, q, k, cos, sin, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos.stride(0), sin.stride(0),
        HQ=hq, HK=k.shape[1], HALF=half, BLOCK_D=block_d,
        BLOCK_HQ=_head_block(hq, block_d), BLOCK_HK=_head_block(k.shape[1], block_d),
        # Otherwise the compiler narrows the rounded float32 math to bf16 ops and contracts
        # product + product into one FMA, skipping a rounding the reference does.
        enable_fp_fusion=False,
        **pdl_args(),
    )  # fmt: skip
    return q_out, k_out
