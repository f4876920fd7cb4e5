"""Split-KV paged decode attention in Triton (+ the reduction of the splits): one new token
per row, the KV of long rows split in chunks across programs (see attention/triton_plan.py).
Layout and softmax as in attention.py, whose tile helpers it uses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.attention import (
    NEG_BIG,
    dot_mode,
    head_block,
    load_kv,
    load_kv_at,
    softmax_step,
    tile_slots,
    unit_last_stride,
)
from minisgl.kernels.decode_fold import (
    DecodeFold,
    fold_args,
    fold_constants,
    norm_rope_rows,
    store_new_kv,
)
from minisgl.kernels.fp8_kv import KVRead
from minisgl.kernels.pdl import pdl_args, pdl_wait


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, row_ids_ptr, seq_lens_ptr, num_splits_ptr,
    q_index_ptr, mid_o_ptr, mid_lse_ptr, qk_scale, v_mul,
    stride_qt, stride_qh, stride_cs, stride_ch, stride_pt,
    stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_h,
    k_ptr, v_ptr, pos_ptr, slots_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, eps, n_cols,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_sin,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    GATHER: tl.constexpr, DIRECT: tl.constexpr, KV_F16: tl.constexpr, E5M2: tl.constexpr,
    V_SCALED: tl.constexpr, ASM: tl.constexpr, FOLD: tl.constexpr, HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # One program = one request x one KV head x one KV chunk; the GROUP query heads sharing
    # that KV head form the M dimension of the dots, so each K/V tile is loaded once.
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # The step's metadata (split counts, lengths, rows, the page table) is written by the host
    # before the step, never by a kernel: it is read before the PDL wait (kernels/pdl.py), so
    # its chain of dependent loads overlaps the previous kernel instead of following it.
    n_splits = tl.load(num_splits_ptr + b)
    if split >= n_splits:
        return  # also every program of a padding row (0 splits)
    # GATHER: the one-token rows of a mixed batch; row b's token sits at q_index[b].
    tok = tl.load(q_index_ptr + b).to(tl.int64) if GATHER else b.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b)
    # Must match plan_decode_splits: chunks are BLOCK_N-aligned so only the last tile masks.
    chunk = tl.cdiv(tl.cdiv(seq_len, n_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    row = tl.load(row_ids_ptr + b).to(tl.int64)
    pt_row_ptr = page_table_ptr + row * stride_pt
    offs_n = tl.arange(0, BLOCK_N)
    # Split rows (small batches: a chunk is often one tile) also read the first tile's slots
    # before the wait. Unsplit ones (big batches, many tiles a program) keep every tile in
    # the loop: peeling one there made the offline workload ~3% slower (RESULTS.md).
    PEEL: tl.constexpr = not DIRECT
    if PEEL:
        first_pos = start + offs_n
        first_mask = first_pos < end
        first_slots = tile_slots(pt_row_ptr, first_pos, first_mask, True)
    if FOLD:  # q/k/v arrive raw: norm, RoPE and the K/V store happen here (decode_fold.py)
        cols = tl.arange(0, BLOCK_D)
        partner, c, s, qw, qw_p, kw, kw_p = fold_constants(
            pos_ptr, tok, cos_ptr, sin_ptr, qw_ptr, kw_ptr, stride_cos, stride_sin, cols,
            cols < HEAD_DIM, HEAD_DIM // 2, HAS_NORM, q_ptr.dtype.element_ty,
        )  # fmt: skip
        slot = tl.load(slots_ptr + tok).to(tl.int64)
    pdl_wait(PDL)  # q and the K/V cache: the kernels before this one write them

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    if FOLD:
        if split == n_splits - 1:  # the chunk that holds the new token: store it first
            kv_off = slot * stride_cs + kv_head * stride_ch
            store_new_kv(
                k_ptr + tok * stride_kt + kv_head * stride_kh,
                v_ptr + tok * stride_vt + kv_head * stride_vh, k_cache_ptr + kv_off,
                v_cache_ptr + kv_off, offs_h, offs_d, d_mask, partner, c, s, kw, kw_p, n_cols,
                eps, HAS_NORM, ASM, KV_F16 != 0, E5M2,
            )  # fmt: skip
            # The stores are visible to every thread of the program after it: the tiles
            # below read the new token back from the cache (the peeled one included).
            tl.debug_barrier()
        # After the store (not before it), so that the other chunks' programs load q and
        # their first K/V tile together, as without the fold.
        q = norm_rope_rows(
            q_ptr + tok * stride_qt, heads * stride_qh, h_mask, offs_d, d_mask, partner, c, s,
            qw, qw_p, n_cols, eps, HAS_NORM, ASM,
        )  # fmt: skip
    else:
        q_off = tok * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptr + q_off, mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if KV_F16:
        q = q.to(tl.float16)  # fp8 tiles reach the dots as float16 (fp8_kv.py)
    if UPCAST:
        q = q.to(tl.float32)  # K/V tiles follow q's dtype

    m_i = tl.full([BLOCK_H], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    loop_start = start
    if PEEL:
        # The first tile, peeled off the loop: the same arithmetic as the loop's (an empty
        # chunk: all masked, as no iteration).
        k, v = load_kv_at(
            k_cache_ptr, v_cache_ptr, first_slots, first_mask, kv_head, stride_cs, stride_ch,
            offs_d, d_mask, q.dtype, True, KV_F16, E5M2, ASM,
        )  # fmt: skip
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        m_i, l_i, acc = softmax_step(
            q, k, v, first_mask[None, :], m_i, l_i, acc, qk_scale, DOT_PREC, True
        )
        loop_start = start + BLOCK_N
    for n0 in range(loop_start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        k, v = load_kv(
            k_cache_ptr, v_cache_ptr, pt_row_ptr, pos, n_mask, kv_head, stride_cs, stride_ch,
            offs_d, d_mask, q.dtype, True, KV_F16, E5M2, ASM,
        )  # fmt: skip
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        m_i, l_i, acc = softmax_step(
            q, k, v, n_mask[None, :], m_i, l_i, acc, qk_scale, DOT_PREC, True
        )

    # An empty chunk (only possible if the host plan and this kernel disagree) reports
    # lse = -inf so the reduction gives it zero weight instead of NaN.
    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    lse = tl.where(has, m_i + tl.log2(l_safe), float("-inf"))
    # DIRECT (no split): the result is final and goes straight to the output token's row.
    mo_row = tok if DIRECT else b.to(tl.int64)
    mo = mo_row * stride_mo_b + heads[:, None] * stride_mo_h + split * stride_mo_s + offs_d[None, :]
    o = acc / l_safe[:, None]
    if V_SCALED:
        o = o * v_mul  # V's scale (and the bit moves' 256) on the result: linear in V
    tl.store(mid_o_ptr + mo, o, mask=h_mask[:, None] & d_mask[None, :])
    ml = b * stride_ml_b + heads * stride_ml_h + split
    tl.store(mid_lse_ptr + ml, lse, mask=h_mask)


@triton.jit
def _decode_reduce_kernel(
    mid_o_ptr, mid_lse_ptr, num_splits_ptr, q_index_ptr, out_ptr,
    stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_h, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, GATHER: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    n_splits = tl.load(num_splits_ptr + b)  # host-written metadata: before the wait
    if n_splits == 0:
        return  # a padding row
    tok = tl.load(q_index_ptr + b).to(tl.int64) if GATHER else b.to(tl.int64)
    pdl_wait(PDL)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < n_splits
    d_mask = offs_d < HEAD_DIM
    lse_ptr = mid_lse_ptr + b * stride_ml_b + h * stride_ml_h + offs_s
    lse = tl.load(lse_ptr, mask=s_mask, other=float("-inf"))
    live = lse > float("-inf")
    m = tl.max(tl.where(live, lse, NEG_BIG), 0)
    w = tl.where(live, tl.exp2(lse - m), 0.0)
    mo = b * stride_mo_b + h * stride_mo_h + offs_s[:, None] * stride_mo_s + offs_d[None, :]
    o = tl.load(mid_o_ptr + mo, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    denom = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    dst = out_ptr + tok * stride_ot + h * stride_oh + offs_d
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    row_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    num_splits: torch.Tensor,
    max_splits: int,
    sm_scale: float,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    q_index: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    kv: KVRead = KVRead(),
    fold: DecodeFold | None = None,
) -> torch.Tensor:
    """One new token per row: q [B, Hq, D] -> out [B, Hq * D]. The grid (B, Hk, max_splits)
    depends only on B, so a CUDA graph replays with new lengths; ``num_splits`` [B] (device,
    from ``plan_decode_splits`` with this ``block_n``) says how many chunks a row uses; a
    row with 0 splits is padding and writes nothing.

    With ``q_index`` [B] the rows are the one-token rows of a mixed batch: row b's query is
    token ``q_index[b]`` of q [T, Hq, D], and its result goes to that token's row of ``out``
    [T, Hq, D] (shared with the extend kernel, which writes the other tokens). ``kv``: the
    cache's scales and how fp8 tiles are converted (kernels/fp8_kv.py).

    With ``fold`` (a pure decode step, no ``q_index``; the cache's scales 1.0) q arrives
    raw, before its norm and RoPE, and the kernel also norms, rotates and stores the new
    k/v (kernels/decode_fold.py): what fused_qk_norm_rope_store would do before it."""
    assert fold is None or (q_index is None and kv.k_scale == kv.v_scale == 1.0)
    q = unit_last_stride(q)
    k_cache, v_cache, qk_scale, v_mul, kv_consts = kv.launch(k_cache, v_cache, q.dtype, sm_scale)
    num_tokens, hq, d = q.shape
    bsz = num_tokens if q_index is None else q_index.shape[0]
    hk = k_cache.shape[1]
    group = hq // hk
    block_d = head_block(d)
    if out is None:
        out = torch.empty(num_tokens, hq, d, dtype=q.dtype, device=q.device)
    gather = q_index is not None
    q_index_arg = q_index if q_index is not None else num_splits
    fold_in, fold_consts = fold_args(fold, q)
    if max_splits == 1:
        # No row is split (a big batch fills the GPU): each program's result is final, so
        # it is written straight into the output and the reduction kernel is skipped.
        mid_o, mo_strides = out, (out.stride(0), out.stride(1), 0)
        mid_lse = torch.empty(bsz, hq, 1, dtype=torch.float32, device=q.device)
    else:
        mid_o = torch.empty(bsz, hq, max_splits, d, dtype=torch.float32, device=q.device)
        mo_strides = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2))
        mid_lse = torch.empty(bsz, hq, max_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(bsz, hk, max_splits)](
        q, k_cache, v_cache, page_table, row_ids, seq_lens, num_splits, q_index_arg, mid_o,
        mid_lse, qk_scale, v_mul,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), page_table.stride(0),
        *mo_strides, mid_lse.stride(0), mid_lse.stride(1), *fold_in,
        GROUP=group, HEAD_DIM=d, BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d, BLOCK_N=block_n, **dot_mode(q.dtype), GATHER=gather,
        DIRECT=max_splits == 1, **kv_consts, **fold_consts, num_warps=num_warps,
        num_stages=num_stages, **pdl_args(),
    )  # fmt: skip
    if max_splits == 1:
        return out.view(num_tokens, hq * d)
    _decode_reduce_kernel[(bsz, hq)](
        mid_o, mid_lse, num_splits, q_index_arg, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=d, BLOCK_S=max(2, triton.next_power_of_2(max_splits)), BLOCK_D=block_d,
        GATHER=gather, num_warps=2 if block_d <= 64 else 4, **pdl_args(),
    )  # fmt: skip
    return out.view(num_tokens, hq * d)
