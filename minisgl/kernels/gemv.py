"""Skinny GEMM as a Triton kernel: y = x W^T (+ b) for batch-1 decoding (kernel: 1-4 rows).

At batch 1 a decode step reads every weight once, so the linear layers should stream W at
HBM bandwidth. Each program owns BLOCK_N output columns for every row and streams their
weight rows once, accumulating x * w elementwise in float32 registers over the whole of K and
reducing across K only at the end (no reduction inside the loop, no second kernel).

Where it wins, measured on the H200 inside CUDA graphs (benchmark/gpu/bench_gemv.py,
benchmark/RESULTS.md): one row on weights up to ~64M elements, e.g. Qwen3-8B's o projection
7.1 vs 10.5 us and down 25.4 vs 28.5 us, Qwen3-0.6B's o 2.6 vs 12.4 us (cuBLAS runs a split-K
GEMM plus a reduction there). cuBLAS stays on the widest weights (8B gate_up, LM heads) and
on 2-4 rows, where it was faster at every tile tried.
"""

from __future__ import annotations

import json

import torch
import triton
import triton.language as tl

from minisgl.kernels import GemvTiles, cdiv
from minisgl.kernels.pdl import pdl_args, pdl_wait

MAX_ROWS = 4


@triton.jit
def _load_x(ptrs, mask, k_dim, SILU_X: tl.constexpr):
    """A tile of x; SILU_X: x is the gated MLP's [gate | up] (each k_dim wide) and the tile
    is silu(gate) * up, rounded as kernels/activation.py rounds it (the same bits)."""
    if SILU_X:
        dtype = ptrs.dtype.element_ty
        gate = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(ptrs + k_dim, mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        return (act * up).to(dtype)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit(do_not_specialize=["rows"])
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, rows, n_cols, k_dim, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, SILU_X: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # (The peer-memory extension's pushing GEMV repeats the unbiased arithmetic
    # with a push of its own: a change here must be made there too, where a test checks
    # the two bit-equal.)
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < rows
    n_mask = offs_n < n_cols
    dtype = out_ptr.dtype.element_ty
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    # No kernel writes the weights: the first K tile is requested before waiting for the
    # previous kernel (programmatic dependent launch), so its memory latency overlaps that
    # kernel's tail. The first iteration is peeled off the loop for it (same arithmetic).
    # (Names of their own: a name reassigned inside the loop would become loop-carried.)
    mask0 = n_mask[:, None] & (offs_k < k_dim)[None, :]
    w0 = tl.load(w_rows + offs_k[None, :], mask=mask0, other=0.0)
    # The bias too: loaded after the final reduction it costs one more memory round trip.
    bias = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    x_mask0 = m_mask[:, None] & (offs_k < k_dim)[None, :]
    x0 = _load_x(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], x_mask0, k_dim, SILU_X)
    acc += x0.to(tl.float32)[:, None, :] * w0.to(tl.float32)[None, :, :]
    for k0 in range(BLOCK_K, k_dim, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < k_dim
        w_mask = n_mask[:, None] & k_mask[None, :]
        x_off = x_ptr + offs_m[:, None] * stride_xm + kk[None, :]
        x = _load_x(x_off, m_mask[:, None] & k_mask[None, :], k_dim, SILU_X).to(tl.float32)
        w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0)
        acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += bias[None, :]
    dst = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(dst, y.to(dtype), mask=m_mask[:, None] & n_mask[None, :])


Tiles = GemvTiles


# Tiles per (rows, N, K) that override the rule below, None meaning cuBLAS: set by tuning runs
# (benchmark/offline/bench_latency.py --gemv-table, from bench_gemv.py --write-table).
TABLE: dict[tuple[int, int, int], Tiles | None] = {}


def load_table(path: str) -> None:
    """Read a JSON list of [rows, N, K, tiles or null (cuBLAS)] into TABLE."""
    with open(path) as f:
        TABLE.update({(r, n, k): tuple(t) if t else None for r, n, k, t in json.load(f)})


def gemv_tiles(rows: int) -> Tiles:
    """Default tiles: ~8k float32 accumulators per program."""
    block_m = triton.next_power_of_2(max(rows, 1))
    return block_m, 16 // block_m if block_m < 16 else 1, 512, 4, 3


def gemv_choice(rows: int, n_cols: int, k_dim: int) -> Tiles | None:
    """The tiles for this product, or None where cuBLAS is faster: the best tiles of the
    H200 sweep per shape, as a rule (a TABLE entry overrides it)."""
    if (rows, n_cols, k_dim) in TABLE:
        return TABLE[rows, n_cols, k_dim]
    if rows != 1 or n_cols * k_dim > 64 * 2**20:
        return None
    if n_cols <= 1024:
        return 1, 4, 2048, 4, 4  # few column blocks: each program streams a long K
    # Qwen3-8B's down: the best tiles of the cold sweep (weights evicted from L2 between
    # calls, as in decoding); 8B batch 1 went 4.91 -> 4.60 ms/token with them (RESULTS.md).
    if k_dim >= 8192 or (k_dim >= 4096 and n_cols <= 4096):
        return 1, 8, 1024, 4, 4
    return 1, 8, 512, 4, 4


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: Tiles | None = None,
    silu_x: bool = False,
) -> torch.Tensor:
    """x [M, K] (M <= 4) times weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype.
    ``silu_x``: x is a gated MLP's [M, 2K] gate and up, and the product is that of
    silu(gate) * up (kernels/activation.py's result, bit for bit) without a kernel for it."""
    rows, k_dim = x.shape
    k_dim = k_dim // 2 if silu_x else k_dim
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
        HAS_BIAS=bias is not None, SILU_X=silu_x, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=warps, num_stages=stages, **pdl_args(),
    )  # fmt: skip
    return out
