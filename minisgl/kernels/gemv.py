"""Skinny GEMM (1-4 rows) as a Triton kernel: y = x W^T (+ b) for batch-1..4 decoding.

At batch 1 a decode step reads every weight once, so the linear layers should stream W at
HBM bandwidth. cuBLAS reaches 3.1-3.6 TB/s on the mid-sized matrices of an 8B model on the
H200 (the qkv, o and down projections: 33-100 MB; benchmark/RESULTS.md), and adds a split-K
reduction kernel for some. Here each program owns BLOCK_N output columns for every row and
streams their weight rows once, accumulating x * w elementwise in float32 registers over the
whole of K and reducing across K only at the end (no reduction inside the loop, no second
kernel). Opt-in (MINISGL_TRITON_GEMV=1, read by layers/cpu_linear.py) until the H200 sweep
(benchmark/gpu/bench_gemv.py) shows where it wins.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels import cdiv

MAX_ROWS = 4


@triton.jit(do_not_specialize=["rows"])
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, rows, n_cols, k_dim, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < rows
    n_mask = offs_n < n_cols
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < k_dim
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    dst = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gemv_tiles(rows: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): ~8k float32 accumulators per program."""
    block_m = triton.next_power_of_2(max(rows, 1))
    return block_m, 16 // block_m if block_m < 16 else 1, 512, 4, 3


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= 4) times weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype."""
    rows, k_dim = x.shape
    n_cols = weight.shape[0]
    assert rows <= MAX_ROWS and weight.shape[1] == k_dim and weight.stride(1) == 1
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, n_cols, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_m, block_n, block_k, warps, stages = tiles or gemv_tiles(rows)
    _gemv_kernel[(cdiv(n_cols, block_n),)](
        x, weight, bias if bias is not None else weight, out, rows, n_cols, k_dim,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
