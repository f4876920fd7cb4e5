"""Paged attention kernels in Triton: causal extend here, split-KV decode (+ reduction) in
decode_attention.py; the tile helpers both use.

K/V live in the pool as [num_slots, Hk, D]; each request's token j sits at slot
``page_table[row, j]``. Kernels read that slot per token, so any page size works.
Softmax runs online in float32 in the base-2 domain (scores pre-multiplied by log2(e)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.fp8_kv import KVRead, fp8_tile_as_f16
from minisgl.kernels.pdl import pdl_args, pdl_wait

# Running-max start value: finite, so a tile whose scores are all masked gives
# exp2(-inf - (-1e30)) = 0 rather than the NaN that -inf - (-inf) would.
NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)


@triton.jit
def tile_slots(pt_row_ptr, pos, n_mask, MASK_N: tl.constexpr):
    """The KV pool slots of one tile's tokens, from the request's page-table row."""
    if MASK_N:
        return tl.load(pt_row_ptr + pos, mask=n_mask, other=0).to(tl.int64)
    return tl.load(pt_row_ptr + pos).to(tl.int64)


@triton.jit
def load_kv(
    k_cache_ptr, v_cache_ptr, pt_row_ptr, pos, n_mask, kv_head, stride_cs, stride_ch,
    offs_d, d_mask, dtype: tl.constexpr, MASK_N: tl.constexpr, KV_F16: tl.constexpr = 0,
    E5M2: tl.constexpr = False, ASM: tl.constexpr = False,
):  # fmt: skip
    """Gather one tile of K and V through the page table (one slot index per token), as
    ``dtype`` (q's: an fp8 pool, --kv-cache-dtype, is upcast here), or with ``KV_F16`` as
    float16 (fp8_kv.py's modes; q is then float16 too)."""
    slots = tile_slots(pt_row_ptr, pos, n_mask, MASK_N)
    return load_kv_at(
        k_cache_ptr, v_cache_ptr, slots, n_mask, kv_head, stride_cs, stride_ch, offs_d, d_mask,
        dtype, MASK_N, KV_F16, E5M2, ASM,
    )  # fmt: skip


@triton.jit
def load_kv_at(
    k_cache_ptr, v_cache_ptr, slots, n_mask, kv_head, stride_cs, stride_ch, offs_d, d_mask,
    dtype: tl.constexpr, MASK_N: tl.constexpr, KV_F16: tl.constexpr = 0,
    E5M2: tl.constexpr = False, ASM: tl.constexpr = False,
):  # fmt: skip
    """load_kv with the tile's slots already read."""
    if MASK_N:
        mask = n_mask[:, None] & d_mask[None, :]
    else:
        mask = d_mask[None, :]
    off = slots[:, None] * stride_cs + kv_head * stride_ch + offs_d[None, :]
    if KV_F16 != 0:  # the caches' bytes (uint8)
        k = tl.load(k_cache_ptr + off, mask=mask, other=0)
        v = tl.load(v_cache_ptr + off, mask=mask, other=0)
    else:
        k = tl.load(k_cache_ptr + off, mask=mask, other=0.0)
        v = tl.load(v_cache_ptr + off, mask=mask, other=0.0)
    if KV_F16 == 0:
        k, v = k.to(dtype), v.to(dtype)
    else:
        k, v = fp8_tile_as_f16(k, E5M2, KV_F16, ASM), fp8_tile_as_f16(v, E5M2, KV_F16, ASM)
    return k, v


@triton.jit
def softmax_step(
    q, k, v, s_mask, m_i, l_i, acc, qk_scale, DOT_PREC: tl.constexpr, MASK_S: tl.constexpr
):  # fmt: skip
    """Fold one KV tile into the running (max, sum, acc) of an online softmax."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    if MASK_S:
        s = tl.where(s_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, page_table_ptr, row_ids_ptr, prefix_lens_ptr,
    ext_lens_ptr, ext_starts_ptr, block_batch_ptr, block_qstart_ptr, qk_scale, v_mul,
    stride_qt, stride_qh, stride_cs, stride_ch, stride_pt, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    KV_F16: tl.constexpr, E5M2: tl.constexpr, V_SCALED: tl.constexpr, ASM: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(PDL)
    # One program = one BLOCK_M tile of a row's new queries x one query head. The host lists
    # exactly the tiles that exist, so ragged batches launch no idle programs.
    blk = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    b = tl.load(block_batch_ptr + blk)
    q0 = tl.load(block_qstart_ptr + blk)
    prefix = tl.load(prefix_lens_ptr + b)
    ext = tl.load(ext_lens_ptr + b)
    tok0 = tl.load(ext_starts_ptr + b)
    row = tl.load(row_ids_ptr + b).to(tl.int64)
    pt_row_ptr = page_table_ptr + row * stride_pt

    offs_m = q0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < ext
    d_mask = offs_d < HEAD_DIM
    q_pos = prefix + offs_m
    tok = (tok0 + offs_m).to(tl.int64)
    q_off = tok[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if KV_F16:
        q = q.to(tl.float16)  # fp8 tiles reach the dots as float16 (fp8_kv.py)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys before this tile's first query are visible to all its queries: no causal mask.
    full_end = (prefix + q0) // BLOCK_N * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        pos = n0 + offs_n
        k, v = load_kv(
            k_cache_ptr, v_cache_ptr, pt_row_ptr, pos, pos, kv_head, stride_cs, stride_ch,
            offs_d, d_mask, q.dtype, False, KV_F16, E5M2, ASM,
        )  # fmt: skip
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        m_i, l_i, acc = softmax_step(q, k, v, pos, m_i, l_i, acc, qk_scale, DOT_PREC, False)
    # Diagonal band; tiles past the last valid query's position are never visited.
    kv_end = prefix + tl.minimum(q0 + BLOCK_M, ext)
    for n0 in range(full_end, kv_end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < kv_end
        k, v = load_kv(
            k_cache_ptr, v_cache_ptr, pt_row_ptr, pos, n_mask, kv_head, stride_cs, stride_ch,
            offs_d, d_mask, q.dtype, True, KV_F16, E5M2, ASM,
        )  # fmt: skip
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        causal = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        m_i, l_i, acc = softmax_step(q, k, v, causal, m_i, l_i, acc, qk_scale, DOT_PREC, True)

    # Every query sees key 0, so l_i > 0 on real rows; padding rows are not stored.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if V_SCALED:
        out = out * v_mul  # V's scale (and the bit moves' 256): attention is linear in V
    o_off = tok[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    o_mask = m_mask[:, None] & d_mask[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=o_mask)


_INTERPRETED = type(_extend_kernel).__name__ == "InterpretedFunction"


def dot_mode(dtype: torch.dtype) -> dict[str, object]:
    # fp32 would otherwise run on TF32 tensor cores (~1e-3 error); 16-bit ignores the flag.
    # Triton's interpreter multiplies the raw bits of bf16 tl.dot operands: upcast there.
    upcast = _INTERPRETED and dtype != torch.float32
    return {"DOT_PREC": "ieee" if upcast or dtype == torch.float32 else "tf32", "UPCAST": upcast}


def unit_last_stride(q: torch.Tensor) -> torch.Tensor:
    # Token/head strides are passed, so views of a fused QKV output need no copy.
    return q if q.stride(-1) == 1 else q.contiguous()


def head_block(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every dim >= 16


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    row_ids: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_starts: torch.Tensor,
    block_batch: torch.Tensor,
    block_qstart: torch.Tensor,
    sm_scale: float,
    block_m: int,
    block_n: int,
    num_warps: int = 4,
    out: torch.Tensor | None = None,
    kv: KVRead = KVRead(),
) -> torch.Tensor:
    """Causal attention of new tokens over prefix + themselves: q [T, Hq, D] -> [T, Hq * D].
    ``block_batch``/``block_qstart`` [NB] give each BLOCK_M query tile's row and first new
    token within the row; the grid is (NB, Hq). ``kv``: the cache's scales and how fp8 tiles
    are converted (kernels/fp8_kv.py)."""
    q = unit_last_stride(q)
    k_cache, v_cache, qk_scale, v_mul, kv_consts = kv.launch(k_cache, v_cache, q.dtype, sm_scale)
    num_tokens, hq, d = q.shape
    hk = k_cache.shape[1]
    if out is None:
        out = torch.empty(num_tokens, hq, d, dtype=q.dtype, device=q.device)
    num_blocks = block_batch.shape[0]
    if num_blocks == 0:
        return out.view(num_tokens, hq * d)
    _extend_kernel[(num_blocks, hq)](
        q, k_cache, v_cache, out, page_table, row_ids, prefix_lens, extend_lens, extend_starts,
        block_batch, block_qstart, qk_scale, v_mul,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), page_table.stride(0),
        out.stride(0), out.stride(1),
        GROUP=hq // hk, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=head_block(d),
        **dot_mode(q.dtype), **kv_consts, num_warps=num_warps, num_stages=2, **pdl_args(),
    )  # fmt: skip
    return out.view(num_tokens, hq * d)
