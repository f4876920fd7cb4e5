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

Tiles are (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, FLAT). FLAT (one row) forms the
products in the weights' own 2-D layout instead of a 3-D [rows, N, K] one, which in the sm_90
SASS sends each weight tile through shared memory (RESULTS.md, 2026-12-06); the rule takes it
where the cold sweep of the small weights (Qwen3-0.6B's) found it fastest (2026-12-08).
"""

from __future__ import annotations

import json

import torch
import triton
import triton.language as tl

from minisgl.kernels import GemvTiles, cdiv
from minisgl.kernels.activation import silu_mul
from minisgl.kernels.pdl import pdl_args, pdl_wait

MAX_ROWS = 4


@triton.jit
def _x_tile(x_ptr, res_ptr, nw_ptr, offs_m, kk, mask, stride_xm, stride_rm, k_dim, rstd,
            SILU_X: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
    """The x tile [BLOCK_M, BLOCK_K] at inputs ``kk``, in x's dtype.

    SILU_X: x is the gated MLP's [gate | up] (each k_dim wide) and the tile is silu(gate) * up,
    rounded as kernels/activation.py rounds it (the same bits). NORM: the tile is RMSNorm's
    output (kernels/norm.py's roundings) of x (1) or of x + residual (2), ``rstd`` [BLOCK_M]
    being the rows' 1 / rms."""
    ptrs = x_ptr + offs_m[:, None] * stride_xm + kk[None, :]
    dtype = x_ptr.dtype.element_ty
    if SILU_X:
        gate = tl.load(ptrs, mask=mask, other=0.0)
        return silu_mul(gate, tl.load(ptrs + k_dim, mask=mask, other=0.0), dtype)
    x = tl.load(ptrs, mask=mask, other=0.0)
    if NORM:
        if NORM == 2:
            r = tl.load(res_ptr + offs_m[:, None] * stride_rm + kk[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        y = (x.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)
        w = tl.load(nw_ptr + kk, mask=kk < k_dim, other=0.0).to(tl.float32)
        x = (y * w[None, :]).to(dtype)
    return x


@triton.jit
def _rows_rstd(x_ptr, res_ptr, res_out_ptr, offs_m, m_mask, stride_xm, stride_rm, k_dim,
               eps, write_res, BLOCK_M: tl.constexpr, NORM_K: tl.constexpr,
               NORM: tl.constexpr):  # fmt: skip
    """1 / rms of each row of x (NORM 1) or x + residual (NORM 2, whose rounded sum the
    program with ``write_res`` stores: the layer's next residual), summed in NORM_K steps
    (an order of its own: kernels/norm.py sums one row tile with its own warps, so rstd may
    differ in the last float32 bit). Every program waits for this before its products, so
    a row fits one step where it can (norm_k): one memory round trip, not one a K tile."""
    dtype = x_ptr.dtype.element_ty
    offs_k = tl.arange(0, NORM_K)
    ss = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, k_dim, NORM_K):
        kk = k0 + offs_k
        mask = m_mask[:, None] & (kk < k_dim)[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :], mask=mask, other=0.0)
        if NORM == 2:
            r = tl.load(res_ptr + offs_m[:, None] * stride_rm + kk[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
            if write_res:
                tl.store(res_out_ptr + offs_m[:, None] * k_dim + kk[None, :], x, mask=mask)
        xf = x.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
    return tl.rsqrt(ss / k_dim + eps)


@triton.jit
def tile_products(x, w, BLOCK_K: tl.constexpr, FLAT: tl.constexpr):
    """The step's products in float32: [BLOCK_M, BLOCK_N, BLOCK_K]; FLAT (one row):
    [BLOCK_N, BLOCK_K] in the weights' own layout, which spares the 3-D layout's trip of each
    weight tile through shared memory (sm_90 SASS: 552 -> 408 instructions at 8 x 512)."""
    if FLAT:
        p = tl.reshape(x.to(tl.float32), [BLOCK_K])[None, :] * w.to(tl.float32)
    else:
        p = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    return p


@triton.jit(do_not_specialize=["rows"])
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, res_ptr, nw_ptr, res_out_ptr, rows, n_cols, k_dim, stride_xm,
    stride_wn, stride_om, stride_rm, eps, HAS_BIAS: tl.constexpr, SILU_X: tl.constexpr,
    NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FLAT: tl.constexpr, PDL: tl.constexpr, NORM_K: tl.constexpr,
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
    rstd = tl.zeros([BLOCK_M], tl.float32)
    if NORM:
        rstd = _rows_rstd(x_ptr, res_ptr, res_out_ptr, offs_m, m_mask, stride_xm, stride_rm,
                          k_dim, eps, pid == 0, BLOCK_M, NORM_K, NORM)  # fmt: skip
    xt = (x_ptr, res_ptr, nw_ptr, offs_m)
    x_mask0 = m_mask[:, None] & (offs_k < k_dim)[None, :]
    x0 = _x_tile(*xt, offs_k, x_mask0, stride_xm, stride_rm, k_dim, rstd, SILU_X, NORM)
    acc = tile_products(x0, w0, BLOCK_K, FLAT)
    for k0 in range(BLOCK_K, k_dim, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < k_dim
        w_mask = n_mask[:, None] & k_mask[None, :]
        x_mask = m_mask[:, None] & k_mask[None, :]
        x = _x_tile(*xt, kk, x_mask, stride_xm, stride_rm, k_dim, rstd, SILU_X, NORM)
        w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0)
        acc += tile_products(x, w, BLOCK_K, FLAT)
    if FLAT:
        y = tl.reshape(tl.sum(acc, axis=1), [BLOCK_M, BLOCK_N])
    else:
        y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += bias[None, :]
    dst = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(dst, y.to(dtype), mask=m_mask[:, None] & n_mask[None, :])


Tiles = GemvTiles
# The widest step of the norm prologue's sum of squares. Its loads are all in flight at once:
# (sm_90, no spills) at 4 warps, 2,048 of x and of the residual take 92 registers a thread,
# 4,096 take 139 and would cost resident programs; the FP8 GEMV (8 warps) takes 156 at
# 2,048 or less, 179 at 4,096. Qwen3-0.6B's rows: one step; 8B's: two.
MAX_NORM_K = 2048


def norm_k(k_dim: int) -> int:
    """The norm prologue's step over a row of ``k_dim``: the whole row where it fits."""
    return min(triton.next_power_of_2(k_dim), MAX_NORM_K)


def norm_prologue(
    x: torch.Tensor,
    k_dim: int,
    residual: torch.Tensor | None,
    norm: tuple[torch.Tensor, float, torch.Tensor] | None,
    out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, float]:
    """(residual, norm weight, residual out, NORM, NORM_K, eps) as the GEMV kernels take
    their (add +) RMSNorm prologue from ``norm`` = (norm weight, eps, residual out); x and
    out stand in for the tensors a launch without it does not read."""
    if norm is None:
        return x, x, out, 0, 0, 0.0
    nw, eps, res_out = norm
    if residual is None:
        return x, nw, res_out, 1, norm_k(k_dim), eps
    res = residual if residual.stride(1) == 1 else residual.contiguous()
    return res, nw, res_out, 2, norm_k(k_dim), eps


# Tiles per (rows, N, K) that override the rule below, None meaning cuBLAS: set by tuning runs
# (benchmark/offline/bench_latency.py --gemv-table, from bench_gemv.py --write-table).
TABLE: dict[tuple[int, int, int], Tiles | None] = {}


def load_table(path: str) -> None:
    """Read a JSON list of [rows, N, K, tiles or null (cuBLAS)] into TABLE."""
    with open(path) as f:
        # Tables written before FLAT existed hold five values.
        TABLE.update({(r, n, k): _tiles(t) if t else None for r, n, k, t in json.load(f)})


def _tiles(t: list[int]) -> Tiles:
    return (t[0], t[1], t[2], t[3], t[4], t[5] if len(t) > 5 else 0)


def gemv_tiles(rows: int) -> Tiles:
    """Default tiles: ~8k float32 accumulators per program."""
    block_m = triton.next_power_of_2(max(rows, 1))
    return block_m, 16 // block_m if block_m < 16 else 1, 512, 4, 3, 0


def gemv_choice(rows: int, n_cols: int, k_dim: int) -> Tiles | None:
    """The tiles for this product, or None where cuBLAS is faster: the best tiles of the
    H200 sweep per shape, as a rule (a TABLE entry overrides it)."""
    if (rows, n_cols, k_dim) in TABLE:
        return TABLE[rows, n_cols, k_dim]
    if rows != 1 or n_cols * k_dim > 64 * 2**20:
        return None
    if n_cols <= 1024:  # few column blocks: each program streams a long K (0.6B's o, down)
        return 1, 4, 2048, 8 if k_dim <= 2048 else 4, 3, 1
    if k_dim <= 1024 and n_cols <= 4096:  # a short K: wide FLAT tiles (0.6B's qkv)
        return 1, 16, 1024, 8, 3, 1
    # Qwen3-8B's down: the best tiles of the cold sweep (weights evicted from L2 between
    # calls, as in decoding); 8B batch 1 went 4.91 -> 4.60 ms/token with them (RESULTS.md).
    if k_dim >= 8192 or (k_dim >= 4096 and n_cols <= 4096):
        return 1, 8, 1024, 4, 4, 0
    return 1, 8, 512, 4, 4, 0


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
    k_dim = x.shape[1] // 2 if silu_x else x.shape[1]
    return _launch(x, k_dim, weight, bias, tiles, silu_x=silu_x)


def gemv_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: Tiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) W^T (+ bias), x + residual) in one kernel: the pre-norm of a
    decoder layer inside the batch-1 GEMV that follows it (kernels/norm.py's roundings; its
    1 / rms may differ in the last float32 bit, summed in another order). ``residual`` None:
    the norm of x, and x is returned as the residual, as layers/norm.py does."""
    assert norm_weight.dtype == x.dtype and norm_weight.shape == (x.shape[1],)
    res_out = torch.empty_like(x) if residual is not None else x
    out = _launch(x, x.shape[1], weight, bias, tiles, residual=residual,
                     norm=(norm_weight, eps, res_out))  # fmt: skip
    return out, res_out


def _launch(
    x: torch.Tensor,
    k_dim: int,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tiles: Tiles | None,
    silu_x: bool = False,
    residual: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float, torch.Tensor] | None = None,
) -> torch.Tensor:
    rows = x.shape[0]
    n_cols = weight.shape[0]
    assert rows <= MAX_ROWS and weight.shape[1] == k_dim and weight.stride(1) == 1
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, n_cols, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    res, nw, res_out, mode, nk, eps = norm_prologue(x, k_dim, residual, norm, out)
    block_m, block_n, block_k, warps, stages, flat = tiles or gemv_tiles(rows)
    _gemv_kernel[(cdiv(n_cols, block_n),)](
        x, weight, bias if bias is not None else weight, out, res, nw, res_out, rows, n_cols,
        k_dim, x.stride(0), weight.stride(0), out.stride(0), res.stride(0), eps,
        HAS_BIAS=bias is not None, SILU_X=silu_x, NORM=mode, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, FLAT=bool(flat) and block_m == 1, NORM_K=nk, num_warps=warps,
        num_stages=stages, **pdl_args(),
    )  # fmt: skip
    return out
