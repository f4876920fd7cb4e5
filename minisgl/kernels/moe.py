"""Fused mixture-of-experts for CUDA: block alignment plus a grouped GEMM in Triton.

The T x top_k (token, expert) pairs are grouped by expert and each expert's run is padded to
a multiple of BLOCK_M ("align", kernels/moe_align.py), so every M-block of the grouped GEMM
belongs to exactly one expert and reads that expert's weight tile. Two launches of one kernel
then do the work:

  gate_up: x[pair // top_k] @ w13[e].T -> silu(gate) * up  (fused, [P, I] written once)
  down:    act[pair] @ w2[e].T * routing_weight[pair]       ([P, H])

and a torch sum over top_k combines the pairs. Nothing reads a device value on the host, so
decode steps can be captured in CUDA graphs: launch grids are sized from the worst-case
padding (a function of T alone) and blocks past the real padded length exit at once.

The same kernel multiplies FP8 operands (``FP8``; `ExpertScales` from the quantization
extension): e4m3 A and B, one K step per 128-input group, each step's dot scaled by its rows'
activation scales and its columns' weight scales.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from minisgl.kernels.moe_align import moe_align_block_size
from minisgl.kernels.pdl import pdl_args, pdl_wait


@triton.jit
def step_weight_scales(ptrs, n_ok, SCALAR: tl.constexpr):
    """A K step's weight scales (here and in the W8A8 GEMM): one, or the columns' [1, BLOCK_N]."""
    return tl.load(ptrs) if SCALAR else tl.load(ptrs, mask=n_ok, other=0.0)[None, :]


# Pair and tile counts change every batch: not specialised, so no mid-run compiles.
@triton.jit(do_not_specialize=["num_pairs", "num_pid_m"])
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weight_ptr, a_scale_ptr, b_scale_ptr, sorted_ptr, block_expert_ptr,
    num_padded_ptr, num_pairs, n_out, k_dim, up_offset, num_pid_m, stride_am, stride_ak, stride_be,
    stride_bn, stride_bk, stride_cm, stride_cn, stride_asm, stride_bse, stride_bsn,
    A_ROW_DIV: tl.constexpr, FUSE_SILU: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr, SN: tl.constexpr,
    SK: tl.constexpr, SCALAR_BS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """C[pair, n] = A[pair // A_ROW_DIV] @ B[expert].T for the pairs of one aligned block.

    B is [E, N_total, K]; with FUSE_SILU the program also computes the "up" columns
    ``up_offset`` rows further down B and stores silu(gate) * up. With FP8, A and B are
    e4m3, BLOCK_K is the activations' group, ``a_scale`` [rows of A, K/BLOCK_K] and
    ``b_scale`` [E, N_total/SN, K/SK] float32 (contiguous along K). SCALAR_BS: the columns (and
    up rows) share one block row, so a K step's scaling is one multiply-add per output.
    """
    pdl_wait(PDL)
    # Grouped ordering: GROUP_M consecutive M-blocks (mostly one expert) sweep the N
    # blocks together, so an expert's weight tiles are reused from L2.
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(n_out, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_size = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # past the last real block: the grid is sized for the worst case

    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = pair < num_pairs  # padding slots hold num_pairs
    a_row = pair // A_ROW_DIV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_out
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    # FP8 scales (dead code otherwise): the rows' per-group activation scales, the columns'
    # weight scales (gate and up rows each read their own block row).
    as_ptrs = a_scale_ptr + a_row * stride_asm
    offs_bs = pid_n * BLOCK_N if SCALAR_BS else offs_n
    bs_ptrs = b_scale_ptr + expert * stride_bse + (offs_bs // SN) * stride_bsn
    bs_up_ptrs = b_scale_ptr + expert * stride_bse + ((offs_bs + up_offset) // SN) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # dead code unless FUSE_SILU
    for k0 in range(0, k_dim, BLOCK_K):
        k_ok = offs_k < k_dim - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if FP8:
            a_s = tl.load(as_ptrs + k0 // BLOCK_K, mask=row_ok, other=0.0)[:, None]
            s = a_s * step_weight_scales(bs_ptrs + k0 // SK, n_ok, SCALAR_BS)
            acc += tl.dot(a, b, input_precision=DOT_PREC) * s
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
        if FUSE_SILU:
            b_up = tl.load(
                b_ptrs + up_offset * stride_bn, mask=k_ok[:, None] & n_ok[None, :], other=0.0
            )
            if UPCAST:
                b_up = b_up.to(tl.float32)
            if FP8:
                s_up = a_s * step_weight_scales(bs_up_ptrs + k0 // SK, n_ok, SCALAR_BS)
                acc_up += tl.dot(a, b_up, input_precision=DOT_PREC) * s_up
            else:
                acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    # Round where the torch reference rounds (each matmul output, silu, then the product),
    # so 16-bit results agree with it to the last bit or so.
    out_ty = c_ptr.dtype.element_ty
    if FUSE_SILU:
        gate = acc.to(out_ty).to(tl.float32)
        up = acc_up.to(out_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
        res = act * up
    else:
        res = acc
    if MUL_WEIGHT:
        w = tl.load(weight_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
        res = res.to(out_ty).to(tl.float32) * w[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, res.to(out_ty), mask=row_ok[:, None] & n_ok[None, :])


_INTERPRETED = type(_moe_gemm_kernel).__name__ == "InterpretedFunction"


def _block_m(num_pairs: int, num_experts: int) -> int:
    """BLOCK_M of the grouped GEMM (and of the alignment) for ``num_pairs`` routed pairs."""
    # Expected pairs per expert decides how much of a block is padding: small blocks for
    # decode (a handful of tokens per expert), larger ones for prefill.
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 16 else (32 if per_expert <= 64 else 64)


class GemmScales(NamedTuple):
    """FP8 operands' scales for `_launch_gemm`: ``a`` float32 [rows of A, K/128], ``b`` float32
    [E, N_total/SN, K/SK] (SN rows x SK inputs of an expert's weight), contiguous along K."""

    a: torch.Tensor
    b: torch.Tensor


def _tiles(a: torch.Tensor, n_out: int, k_dim: int, fp8: bool) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, stages); FP8 steps K one 128-input activation group at a time."""
    block_n = 64 if n_out >= 64 else max(16, triton.next_power_of_2(n_out))
    if fp8:
        return block_n, 128, 3
    block_k = 64 if k_dim >= 64 else max(16, triton.next_power_of_2(k_dim))
    if a.dtype == torch.float32 and not _INTERPRETED:
        block_k = min(block_k, 32)  # fp32 tiles double the shared memory per stage
    return block_n, block_k, 2 if a.dtype == torch.float32 else 3


def _launch_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    weights: torch.Tensor | None,
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    block_m: int,
    a_row_div: int,
    fuse_silu: bool,
    scales: GemmScales | None = None,
) -> None:
    """One launch of the grouped GEMM (see `_moe_gemm_kernel`); ``scales``: A and B are
    e4m3 (K a multiple of 128)."""
    sorted_pairs, block_expert, num_padded = align
    n_out, k_dim = c.shape[1], b.shape[2]
    block_n, block_k, stages = _tiles(a, n_out, k_dim, scales is not None)
    num_pid_m = block_expert.numel()
    grid = (num_pid_m * triton.cdiv(n_out, block_n),)
    # fp32 would otherwise run on TF32 tensor cores (~1e-3 error); 16-bit ignores the flag.
    # Triton's interpreter multiplies the raw bits of bf16 tl.dot operands: upcast there.
    upcast = _INTERPRETED and a.dtype != torch.float32
    sn, sk, scalar_bs = 1, 1, False  # unused without scales
    if scales is not None:
        sn, sk = b.shape[1] // scales.b.shape[1], k_dim // scales.b.shape[2]
        assert k_dim % block_k == 0 and sk % block_k == 0, (k_dim, sk)
        assert scales.a.stride(1) == 1 and scales.b.stride(2) == 1  # the kernel steps K by 1
        scalar_bs = sn % block_n == 0 and (not fuse_silu or n_out % sn == 0)
    a_s, b_s = scales if scales is not None else (c, c)
    _moe_gemm_kernel[grid](
        a, b, c, weights if weights is not None else c, a_s, b_s,
        sorted_pairs, block_expert, num_padded, c.shape[0], n_out, k_dim,
        n_out,  # up rows of w13 follow the n_out gate rows (local shard: [gate; up])
        num_pid_m, a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
        c.stride(0), c.stride(1), a_s.stride(0), b_s.stride(0), b_s.stride(1),
        A_ROW_DIV=a_row_div, FUSE_SILU=fuse_silu, MUL_WEIGHT=weights is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
        DOT_PREC="ieee" if upcast or a.dtype == torch.float32 else "tf32", UPCAST=upcast,
        FP8=scales is not None, SN=sn, SK=sk, SCALAR_BS=scalar_bs, num_warps=4,
        num_stages=stages, **pdl_args(),
    )  # fmt: skip


class ExpertScales(NamedTuple):
    """FP8 experts for `fused_moe_stages`: the weights' scale grids (`GemmScales`'s ``b``) and
    the extension's activation quantizer (x [rows, K] -> e4m3, float32 scales [rows, K/128])."""

    w13: torch.Tensor
    w2: torch.Tensor
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def fused_moe_stages(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    fp8: ExpertScales | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two products before the sum over top_k: (silu(gate) * up [P, I], the pairs'
    weighted down outputs [P, H]) in x's dtype, P = T * top_k pairs in (token, k) order.
    ``fp8``: e4m3 experts, whose inputs (x, then the SiLU-mul output) are quantized first."""
    tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    num_pairs = tokens * top_k
    x = x if x.stride(-1) == 1 else x.contiguous()
    block_m = _block_m(num_pairs, num_experts)
    align = moe_align_block_size(topk_ids, num_experts, block_m)
    act = torch.empty(num_pairs, two_i // 2, dtype=x.dtype, device=x.device)
    a, scales = x, None
    if fp8 is not None:
        a, a_s = fp8.quantize(x)
        scales = GemmScales(a_s, fp8.w13)
    _launch_gemm(a, w13, act, None, align, block_m, top_k, fuse_silu=True, scales=scales)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).to(x.dtype)
    a = act
    if fp8 is not None:
        a, a_s = fp8.quantize(act)
        scales = GemmScales(a_s, fp8.w2)
    _launch_gemm(a, w2, out, weights, align, block_m, 1, fuse_silu=False, scales=scales)
    return act, out


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    fp8: ExpertScales | None = None,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], topk_* [T, K]
    -> sum_k w_k * down_e(silu(gate_e(x)) * up_e(x)) as [T, H] in x's dtype."""
    tokens, hidden = x.shape
    if tokens == 0:
        return torch.zeros_like(x)
    _, out = fused_moe_stages(x, w13, w2, topk_weights, topk_ids, fp8)
    return out.view(tokens, topk_ids.shape[1], hidden).sum(dim=1)
