"""Block-scaled FP8 GEMM (W8A8): y = x W^T (+ b) for more than 4 rows, on e4m3 tensor cores.

Activations are quantized per token and group of GROUP = 128 inputs (dynamic: scale = the
group's max-abs / 448, as DeepSeek-V3's recipe and the fine-grained FP8 checkpoints expect),
by `quantize_groups`; the GEMM then takes one K step per group, so each step's dot of e4m3
tiles (float32 out) is multiplied by its rows' activation scales and its columns' weight
scales (``scales`` [N/SN, K/SK] as in kernels/fp8_gemv.py; SK a multiple of GROUP) before
joining the float32 accumulator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels import cdiv
from minisgl.kernels.activation import silu_mul
from minisgl.kernels.moe import step_weight_scales
from minisgl.kernels.pdl import pdl_args, pdl_wait

GROUP = 128
E4M3_MAX = 448.0


def cublas_rows(rows: int) -> int:
    """Rows of cuBLASLt's block-scaled operands: a multiple of 4, since it asks the activation
    scales' leading dimension (M, column-major) in whole 16 bytes (CUBLAS_STATUS_NOT_SUPPORTED
    at 37 rows on an H100) and torch refuses padded strides. The pad rows may hold anything:
    each output row reads only its own activation row, and `cublas_quantized_gemm` drops them."""
    return -(-rows // 4) * 4


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, rows, groups, stride_xm, stride_sm, stride_sg,
                  GROUP: tl.constexpr, BLOCK_G: tl.constexpr, SILU: tl.constexpr,
                  PDL: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    offs = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (g < groups)[:, None]
    pdl_wait(PDL)
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0)
    if SILU:  # x is a gated MLP's [gate | up]
        up = tl.load(x_ptr + row * stride_xm + groups * GROUP + offs, mask=mask, other=0.0)
        x = silu_mul(x, up, x_ptr.dtype.element_ty)
    x = x.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) / 448.0
    q = (x / scale[:, None]).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + row * groups * GROUP + offs, q, mask=mask)
    tl.store(s_ptr + row * stride_sm + g * stride_sg, scale, mask=g < groups)


def quantize_groups(
    x: torch.Tensor, column_major: bool = False, silu_x: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K % 128 == 0) -> (e4m3 [M, K], float32 scales [M, K/128]), x ~ q * scale.
    ``column_major``: cuBLASLt's layout (`cublas_rows`): the scales' M stride is 1, and both
    outputs have `cublas_rows(M)` rows, the pad rows unwritten. ``silu_x``: x is a gated
    MLP's [M, 2K] [gate | up], and what is quantized is silu(gate) * up as
    kernels/activation.py computes it (bit for bit), never stored."""
    rows, k_dim = x.shape
    k_dim = k_dim // 2 if silu_x else k_dim
    assert k_dim % GROUP == 0 and x.stride(1) == 1
    groups = k_dim // GROUP
    padded = cublas_rows(rows) if column_major else rows
    q = torch.empty(padded, k_dim, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((groups, padded) if column_major else (padded, groups), dtype=torch.float32,
                    device=x.device)  # fmt: skip
    s = s.t() if column_major else s
    if rows:
        block_g = min(8, triton.next_power_of_2(groups))
        _quant_kernel[(rows, cdiv(groups, block_g))](
            x, q, s, rows, groups, x.stride(0), s.stride(0), s.stride(1), GROUP=GROUP,
            BLOCK_G=block_g, SILU=silu_x, **pdl_args(),
        )  # fmt: skip
    return q, s


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, rows, n_cols, k_dim, stride_om, stride_ws,
    SN: tl.constexpr, SK: tl.constexpr, WS_MODE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # WS_MODE (how the weight scales join, cheapest first): 2, one scale per row over all of K
    # (per-channel): applied once after the loop; 1, the program's columns lie in one row of
    # scale blocks: a K step scales its dot by one [BLOCK_M] vector, a multiply-add per output;
    # 0, otherwise: by the [BLOCK_M, BLOCK_N] outer product of both scales.
    # Programs of GROUP_M consecutive row tiles share their column tiles (L2 reuse of W).
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(rows, BLOCK_M)
    tiles_n = tl.cdiv(n_cols, BLOCK_N)
    first_m = (pid // (GROUP_M * tiles_n)) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % size_m
    pid_n = (pid % (GROUP_M * tiles_n)) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < rows
    n_mask = offs_n < n_cols
    groups = k_dim // BLOCK_K
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * k_dim + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * k_dim + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    as_ptrs = as_ptr + offs_m * groups
    ws_ptrs = ws_ptr + ((pid_n * BLOCK_N if WS_MODE == 1 else offs_n) // SN) * stride_ws
    pdl_wait(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for g in range(0, groups):
        a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
        s = tl.load(as_ptrs + g, mask=m_mask, other=0.0)[:, None]
        if WS_MODE != 2:  # per-row scales join after the loop
            s = s * step_weight_scales(ws_ptrs + g * BLOCK_K // SK, n_mask, WS_MODE == 1)
        acc += tl.dot(a, w) * s
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if WS_MODE == 2:
        acc *= tl.load(ws_ptrs, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    dst = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


Tiles = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, warps, stages); BLOCK_K = GROUP


def fp8_gemm_tiles(rows: int) -> Tiles:
    """UNMEASURED defaults: narrow column tiles for decode batches (weight-bound: enough
    programs to cover every SM), 128 x 128 tiles on wgmma for prefill."""
    if rows <= 64:
        return max(16, triton.next_power_of_2(rows)), 32 if rows <= 16 else 64, 4, 5
    if rows <= 256:
        return 64, 128, 4, 4
    return 128, 128, 8, 3


def fp8_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: Tiles | None = None,
    silu_x: bool = False,
) -> torch.Tensor:
    """x [M, K] (K % 128 == 0) times (weight e4m3 [N, K] with ``scales`` [N/SN, K/SK])^T
    (+ bias) -> [M, N] in x's dtype, with x quantized per token and 128 inputs.
    ``silu_x``: x is [M, 2K] [gate | up] and the product is silu(gate) * up's (see
    `quantize_groups`)."""
    assert x.shape[1] == (2 * weight.shape[1] if silu_x else weight.shape[1])
    q, qs = quantize_groups(x if x.stride(1) == 1 else x.contiguous(), silu_x=silu_x)
    return quantized_gemm(q, qs, weight, scales, bias, x.dtype, tiles)


def quantized_gemm(
    q: torch.Tensor,
    qs: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """`fp8_gemm` of activations already quantized (``q`` e4m3 [M, K], ``qs`` float32
    [M, K/128] row-major, as `quantize_groups` or kernels/norm.add_rms_norm_quant give them)."""
    rows, n_cols, k_dim = q.shape[0], weight.shape[0], weight.shape[1]
    sn, sk = n_cols // scales.shape[0], k_dim // scales.shape[1]
    assert q.shape[1] == k_dim and q.is_contiguous() and qs.is_contiguous()
    assert weight.is_contiguous() and sk % GROUP == 0
    out = torch.empty(rows, n_cols, dtype=out_dtype, device=q.device)
    if rows == 0:
        return out
    block_m, block_n, warps, stages = tiles or fp8_gemm_tiles(rows)
    ws_mode = 2 if sk == k_dim else (1 if sn % block_n == 0 else 0)
    grid = (cdiv(rows, block_m) * cdiv(n_cols, block_n),)
    _fp8_gemm_kernel[grid](
        q, qs, weight, scales, bias if bias is not None else scales, out, rows, n_cols, k_dim,
        out.stride(0), scales.stride(0), SN=sn, SK=sk, WS_MODE=ws_mode, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP, GROUP_M=8, num_warps=warps,
        num_stages=stages, **pdl_args(),
    )  # fmt: skip
    return out


def cublas_fp8_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    silu_x: bool = False,
) -> torch.Tensor:
    """`fp8_gemm` on cuBLASLt's block-scaled FP8 GEMM (activations in 1 x 128 groups, weights
    in 128 x 128 blocks, ``scales`` [N/128, K/128]; CUDA >= 12.9 on Hopper): the same quantized
    operands, cuBLAS's tiles and pipelining. The recipes are named (torch.nn.functional.
    scaled_mm): torch._scaled_mm, which infers them from the scales' shapes, got this product
    wrong on an H100 (benchmark/RESULTS.md, 2026-12-06)."""
    x = x if x.stride(1) == 1 else x.contiguous()
    q, qs = quantize_groups(x, column_major=True, silu_x=silu_x)
    return cublas_quantized_gemm(q, qs, weight, scales, bias, x.dtype, x.shape[0])


def cublas_quantized_gemm(
    q: torch.Tensor,
    qs: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    rows: int,
) -> torch.Tensor:
    """`cublas_fp8_gemm` of activations already quantized in cuBLASLt's layout (`cublas_rows`
    rows, ``qs`` column-major), of which the first ``rows`` are real."""
    f = torch.nn.functional
    out = f.scaled_mm(q, weight.t(), qs, f.ScalingType.BlockWise1x128, scales.t(),
                      f.ScalingType.BlockWise128x128, output_dtype=out_dtype)[:rows]  # fmt: skip
    return out if bias is None else out.add_(bias)  # the bias outside: not every recipe takes one
