"""q/k RMSNorm + RoPE + the K/V store of a pure decode step, folded into the split decode
kernel (decode_attention.py's FOLD): at batch 1 a small kernel costs more in launch latency
(~3 µs) than in work, and this saves one launch per layer (on unless ``--disable-fused-decode-rope``).

Every program (row, KV head, chunk) norms and rotates its GROUP query heads from the raw QKV
output. The program holding the row's last chunk, which contains the new token, also norms
and rotates the new k of its KV head and writes k and v into the cache at the token's slot;
after a barrier it reads its tiles from the cache as usual, so the new token is read back
as the unfused path reads it (an fp8 cache's conversion included). Chunks are disjoint: no
other program reads that position.

The arithmetic is qk_rope_store.py's, rounded at the same points: the normalised row
rounded to the activation dtype, times the weight, rounded again; rope.py's products and
sum, each column with its partner in the other half (read from memory: the tile stays
whole for the dots). The sum of squares reduces in the decode kernel's tile (BLOCK_H rows,
its warps), not in norm.py's ``row_tile`` (the same shape only at head_dim 128, groups up
to 16): it may be ordered otherwise, and 1 / rms then differ in its last bit.
The fused kernels compile without FMA contraction; here that would change the softmax's
rounding too, so only the products that feed a sum are kept apart from it (``mul.rn``,
which the compiler does not contract): the attention math compiles as without the fold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minisgl.kernels.store import cast_to_cache


@dataclass(frozen=True)
class DecodeFold:
    """A pure decode step's new tokens for the folded launch: raw k, v [B, Hk, D] (strided
    views of the QKV output; q is passed as decode_attention's q), their cache ``slots``
    [B], RoPE's ``positions`` [B] and ``cos``/``sin`` tables [max_pos, D], and the q/k norm
    weights [D] (both or neither)."""

    k: torch.Tensor
    v: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float = 1e-6


def fold_args(
    fold: DecodeFold | None, q: torch.Tensor
) -> tuple[tuple[object, ...], dict[str, bool]]:
    """The decode kernel's fold arguments (its last) and constants; placeholders
    without a fold."""
    if fold is None:
        return (q,) * 8 + (0.0,) + (0,) * 7, {"FOLD": False, "HAS_NORM": False}
    bsz, hq, d = q.shape
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (fold.k, fold.v))
    assert k.shape == v.shape and k.shape[0] == bsz and k.shape[2] == d, (q.shape, k.shape)
    assert k.dtype == v.dtype == q.dtype and d % 2 == 0, (q.dtype, k.dtype, d)
    assert fold.positions.shape == (bsz,) and fold.slots.shape == (bsz,)
    assert fold.cos.shape[1] == d and fold.sin.shape == fold.cos.shape
    assert fold.cos.stride(1) == 1 and fold.sin.stride(1) == 1
    assert (fold.q_weight is None) == (fold.k_weight is None), "q and k norm come together"
    has_norm = fold.q_weight is not None
    for w in (fold.q_weight, fold.k_weight):
        assert w is None or (w.shape == (d,) and w.is_contiguous() and w.dtype == q.dtype)
    weights = (fold.q_weight, fold.k_weight) if has_norm else (q, q)
    args = (
        k, v, fold.positions, fold.slots, fold.cos, fold.sin, *weights, fold.eps, d,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), fold.cos.stride(0),
        fold.sin.stride(0),
    )  # fmt: skip
    return args, {"FOLD": True, "HAS_NORM": has_norm}


@triton.jit
def _mul(a, b, RN: tl.constexpr):
    """a * b, never contracted with an add that follows it (RN: compiled, not interpreted)."""
    if RN:
        a, b = tl.broadcast(a, b)
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    return a * b


@triton.jit
def fold_constants(
    pos_ptr, b, cos_ptr, sin_ptr, qw_ptr, kw_ptr, stride_cos, stride_sin, offs_d, d_mask,
    HALF: tl.constexpr, HAS_NORM: tl.constexpr, dtype: tl.constexpr,
):  # fmt: skip
    """What the fold reads that no kernel of the step writes (before the PDL wait): each
    column's RoPE partner in the other half, the cos/sin rows of row ``b``'s position cast
    to the activation dtype (sin negated on the first half: out1 = x1 c1 - x2 s1), and the
    q and k norm weights at each column and its partner (float32)."""
    pos = tl.load(pos_ptr + b).to(tl.int64)
    first = offs_d < HALF
    partner = tl.where(first, offs_d + HALF, offs_d - HALF)
    c = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0)
    s = tl.load(sin_ptr + pos * stride_sin + offs_d, mask=d_mask, other=0.0)
    c = c.to(dtype).to(tl.float32)
    s = s.to(dtype).to(tl.float32)
    s = tl.where(first, -s, s)
    qw = tl.zeros_like(c)
    qw_p = tl.zeros_like(c)
    kw = tl.zeros_like(c)
    kw_p = tl.zeros_like(c)
    if HAS_NORM:
        qw = tl.load(qw_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        qw_p = tl.load(qw_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)
        kw = tl.load(kw_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        kw_p = tl.load(kw_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)
    return partner, c, s, qw, qw_p, kw, kw_p


@triton.jit
def norm_rope_rows(
    src_ptr, rows, row_mask, offs_d, d_mask, partner, c, s, w, w_p, n_cols, eps,
    HAS_NORM: tl.constexpr, RN: tl.constexpr,
):  # fmt: skip
    """Rows ``src_ptr + rows`` [R, n_cols] normed (HAS_NORM) and rotated, in the source's
    dtype: qk_rope_store.py's arithmetic, column by column with its partner. ``n_cols`` is
    a runtime value there too (a constant divisor compiles to a multiply that the compiler
    may contract with the ``+ eps``)."""
    dtype = src_ptr.dtype.element_ty
    mask = row_mask[:, None] & d_mask[None, :]
    x = tl.load(src_ptr + rows[:, None] + offs_d[None, :], mask=mask, other=0.0)
    p = tl.load(src_ptr + rows[:, None] + partner[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    p = p.to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(_mul(x, x, RN), axis=1) / n_cols + eps)[:, None]
        x = ((x * rstd).to(dtype).to(tl.float32) * w[None, :]).to(dtype).to(tl.float32)
        p = ((p * rstd).to(dtype).to(tl.float32) * w_p[None, :]).to(dtype).to(tl.float32)
    a = _mul(x, c[None, :], RN).to(dtype).to(tl.float32)
    b = _mul(p, s[None, :], RN).to(dtype).to(tl.float32)
    return (a + b).to(dtype)


@triton.jit
def _as_cache(x, ptr, BYTES: tl.constexpr, E5M2: tl.constexpr):
    """``x`` as the cache stores it (store_kv's cast); BYTES: the kernel sees an fp8 cache
    as its bytes (fp8_kv.py's modes 1-3)."""
    if BYTES:
        if E5M2:
            return cast_to_cache(x, tl.float8e5).to(tl.uint8, bitcast=True)
        return cast_to_cache(x, tl.float8e4nv).to(tl.uint8, bitcast=True)
    return cast_to_cache(x, ptr.dtype.element_ty)


@triton.jit
def store_new_kv(
    k_src, v_src, k_dst, v_dst, offs_h, offs_d, d_mask, partner, c, s, kw, kw_p, n_cols, eps,
    HAS_NORM: tl.constexpr, RN: tl.constexpr, BYTES: tl.constexpr, E5M2: tl.constexpr,
):  # fmt: skip
    """One KV head of the new token: k normed and rotated, v as it is, into the cache rows
    at ``k_dst``/``v_dst``. Computed in the query tile's shape (row 0 only), the shape the
    fused store reduces k in."""
    row0 = offs_h == 0
    at = offs_h * 0
    k = norm_rope_rows(
        k_src, at, row0, offs_d, d_mask, partner, c, s, kw, kw_p, n_cols, eps, HAS_NORM, RN
    )
    mask = row0[:, None] & d_mask[None, :]
    cols = at[:, None] + offs_d[None, :]
    v = tl.load(v_src + cols, mask=mask, other=0.0)
    tl.store(k_dst + cols, _as_cache(k, k_dst, BYTES, E5M2), mask=mask)
    tl.store(v_dst + cols, _as_cache(v, v_dst, BYTES, E5M2), mask=mask)
