"""q/k RMSNorm + RoPE + KV store in one Triton kernel: what each attention layer runs between
the QKV projection and attention, in one launch instead of up to four (q norm, k norm,
RoPE, store_kv). Tiny per-layer kernels cost more in launches than in work.

The result is bit-identical to rms_norm(q), rms_norm(k), apply_rope, store_kv, so turning
the fusion off never changes greedy outputs. Every value is rounded where those kernels
round it, and
- the RMS statistics reduce whole rows in a tile of norm.py's shape and warp count
  (``row_tile``): the compiler lays the sum of squares out, and so orders it, as there;
- RoPE is rope.py's arithmetic on the two halves of each (normalised) row;
- like both of those kernels, it is compiled without FMA contraction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels import cdiv
from minisgl.kernels.norm import row_tile
from minisgl.kernels.pdl import pdl_args, pdl_wait
from minisgl.kernels.rope import load_cos_sin, rotate_halves
from minisgl.kernels.store import cast_to_cache


@triton.jit
def _norm_rope_heads(
    src_ptr, stride_h, dst_ptr, stride_dst_h, w1, w2, h0, n_cols, eps,
    c1, c2, s1, s2, offs_d, d_mask, cols, col_mask,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Heads [h0, h0 + BLOCK_M) of one token: RMSNorm (if HAS_NORM; w1, w2: the halves of
    its weight, [1, BLOCK_D] float32), rotate, store at dst (cast to dst's dtype, as store_kv
    casts to the cache's)."""
    dtype = src_ptr.dtype.element_ty
    offs_h = h0 + tl.arange(0, BLOCK_M)
    h_mask = offs_h < NUM_HEADS
    rows = offs_h[:, None] * stride_h
    half_mask = h_mask[:, None] & d_mask[None, :]
    x1 = tl.load(src_ptr + rows + offs_d[None, :], mask=half_mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + rows + HALF + offs_d[None, :], mask=half_mask, other=0.0)
    x2 = x2.to(tl.float32)
    if HAS_NORM:
        # norm.py's statistics on whole rows of a [BLOCK_M, BLOCK_N] tile (the halves above
        # are re-read from cache): the same layout, so the same summation order.
        row_mask = h_mask[:, None] & col_mask[None, :]
        xf = tl.load(src_ptr + rows + cols[None, :], mask=row_mask, other=0.0).to(tl.float32)
        var = tl.sum(xf * xf, axis=1) / n_cols
        rstd = tl.rsqrt(var + eps)[:, None]
        # Normalised row rounded to the activation dtype, times the weight, rounded again:
        # rms_norm's output, which RoPE then reads.
        x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    y1, y2 = rotate_halves(x1, x2, c1, c2, s1, s2, dtype)  # rope.py's rounding
    out_ty = dst_ptr.dtype.element_ty
    dst = dst_ptr + offs_h[:, None] * stride_dst_h + offs_d[None, :]
    # store_kv's cast (an fp8 cache saturates and rounds as there); q_out's is a plain one.
    tl.store(dst, cast_to_cache(y1, out_ty), mask=half_mask)
    tl.store(dst + HALF, cast_to_cache(y2, out_ty), mask=half_mask)


@triton.jit
def _copy_heads(
    src_ptr, stride_h, dst_ptr, stride_dst_h, h0, cols, col_mask,
    NUM_HEADS: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    offs_h = h0 + tl.arange(0, BLOCK_M)
    mask = (offs_h < NUM_HEADS)[:, None] & col_mask[None, :]
    x = tl.load(src_ptr + offs_h[:, None] * stride_h + cols[None, :], mask=mask)
    dst = dst_ptr + offs_h[:, None] * stride_dst_h + cols[None, :]
    tl.store(dst, cast_to_cache(x, dst_ptr.dtype.element_ty), mask=mask)


# No token-count argument: the count is the grid's first axis, so no batch size compiles a
# new variant (every other argument is fixed per model).
@triton.jit
def _qk_norm_rope_store_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, slots_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
    q_out_ptr, k_cache_ptr, v_cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh,
    stride_cos, stride_sin, stride_cache_slot, stride_cache_h, n_cols, eps,
    HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr,
    Q_CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # Program (token, chunk): chunks [0, Q_CHUNKS) are BLOCK_M q heads each, the rest k and
    # v heads, so even a one-token decode step spreads over a few programs.
    tok = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    # Positions, slots and the cos/sin cache are host-written or constant, never written by a
    # kernel of the step: read before the PDL wait (kernels/pdl.py), only q/k/v after it.
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HALF
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    dtype = q_ptr.dtype.element_ty
    c1, c2, s1, s2 = load_cos_sin(
        cos_ptr, sin_ptr, pos, stride_cos, stride_sin, offs_d, d_mask, HALF, dtype
    )  # as apply_rope reads them
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    # The norm weights too (constant): loaded after the row statistics, they cost one more
    # memory round trip at the end of the kernel.
    is_q = chunk < Q_CHUNKS
    w1 = tl.zeros([1, BLOCK_D], tl.float32)
    w2 = tl.zeros([1, BLOCK_D], tl.float32)
    if HAS_NORM:
        w_ptr = tl.where(is_q, qw_ptr, kw_ptr)
        w1 = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    pdl_wait(PDL)
    if is_q:
        _norm_rope_heads(
            q_ptr + tok * stride_qt, stride_qh, q_out_ptr + tok * stride_qot, stride_qoh, w1, w2,
            chunk * BLOCK_M, n_cols, eps, c1, c2, s1, s2, offs_d, d_mask, cols, col_mask,
            HQ, HALF, HAS_NORM, BLOCK_M,
        )  # fmt: skip
    else:
        h0 = (chunk - Q_CHUNKS) * BLOCK_M
        k_dst = k_cache_ptr + slot * stride_cache_slot
        _norm_rope_heads(
            k_ptr + tok * stride_kt, stride_kh, k_dst, stride_cache_h, w1, w2,
            h0, n_cols, eps, c1, c2, s1, s2, offs_d, d_mask, cols, col_mask,
            HK, HALF, HAS_NORM, BLOCK_M,
        )  # fmt: skip
        v_dst = v_cache_ptr + slot * stride_cache_slot
        _copy_heads(
            v_ptr + tok * stride_vt, stride_vh, v_dst, stride_cache_h, h0, cols, col_mask,
            HK, BLOCK_M,
        )  # fmt: skip


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_weight(w: torch.Tensor, x: torch.Tensor) -> None:
    d = x.shape[-1]
    assert w.shape == (d,) and w.is_contiguous() and w.device == x.device, (w.shape, d)
    # rms_norm would return promote(x, w); RoPE and the cache write here assume x's dtype.
    assert w.dtype == x.dtype, f"norm weight {w.dtype} vs activations {x.dtype}"


def fused_qk_norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """RMSNorm q [T, Hq, D] and k [T, Hk, D] over head_dim (with ``q_weight``/``k_weight``;
    skipped when both are None), rotate them by the ``cos``/``sin`` rows [max_pos, D] of
    ``positions`` [T], write rotated k and untouched v [T, Hk, D] into ``k_cache``/
    ``v_cache`` [num_slots, Hk, D] at ``slots`` [T], and return rotated q as a new
    contiguous [T, Hq, D] tensor. q/k/v may be strided views (e.g. of a fused QKV output).

    Bit for bit: q_norm/k_norm -> apply_rope -> store_kv."""
    assert q.dim() == 3 and k.dim() == 3 and v.shape == k.shape, (q.shape, k.shape, v.shape)
    num_tokens, hq, d = q.shape
    hk = k.shape[1]
    assert k.shape[0] == num_tokens and k.shape[2] == d and d % 2 == 0, (q.shape, k.shape)
    assert k.dtype == q.dtype == v.dtype, (q.dtype, k.dtype, v.dtype)
    assert positions.shape == (num_tokens,) and slots.shape == (num_tokens,)
    assert cos.dim() == 2 and cos.shape[1] == d and sin.shape == cos.shape
    assert cos.stride(1) == 1 and sin.stride(1) == 1
    assert k_cache.shape[1:] == (hk, d) and k_cache.shape == v_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(2) == 1
    assert (q_weight is None) == (k_weight is None), "q and k norm come together"
    if q_weight is not None and k_weight is not None:
        _check_weight(q_weight, q)
        _check_weight(k_weight, k)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    q_out = torch.empty((num_tokens, hq, d), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    block_m, block_n, num_warps = row_tile(d)
    has_norm = q_weight is not None
    q_chunks = cdiv(hq, block_m)
    grid = (num_tokens, q_chunks + cdiv(hk, block_m))
    _qk_norm_rope_store_kernel[grid](
        q, k, v, positions, slots, cos, sin,
        q_weight if q_weight is not None else q, k_weight if k_weight is not None else k,
        q_out, k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), cos.stride(0), sin.stride(0), k_cache.stride(0), k_cache.stride(1),
        d, eps,
        HQ=hq, HK=hk, HALF=d // 2, HAS_NORM=has_norm, Q_CHUNKS=q_chunks,
        BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(d // 2), num_warps=num_warps,
        # As in rope.py (and norm.py): no FMA contraction, no narrowing of the rounded math.
        enable_fp_fusion=False, **pdl_args(),
    )  # fmt: skip
    return q_out
