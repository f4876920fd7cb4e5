"""Batch-1 FP8 GEMV (1-4 rows): y = x W^T (+ b) with W = e4m3 [N, K] times float32 scales.

``scales`` [N / SN, K / SK]: one scale per SN rows x SK inputs, block-wise checkpoints'
128 x 128 blocks or one per row (SN = 1, SK = K: per-channel, and per-tensor repeated over
the tensor's rows). Weight-only: x stays in its dtype (bf16), products are summed in float32.

A decode step at batch 1 reads every weight once, so the product should stream the e4m3
bytes at HBM bandwidth: half the bytes of bf16, hence about half the time. The structure is
kernels/gemv.py's (each program owns BLOCK_N columns for every row, streams their weight rows
once over K, accumulates elementwise in float32 and reduces over K at the end), and the
scales cost no work per weight:
- per-row scales multiply the program's sums once, at the end;
- block scales: a program's columns lie in one row of blocks (BLOCK_N divides SN), so each
  step multiplies its BLOCK_K activations by their block's scale instead of the BLOCK_N x
  BLOCK_K weights: (x_k s_b) q_nk = x_k (q_nk s_b).

Streaming e4m3 is bound by the conversions as much as by the bytes, so the variants cut the
instructions per weight: PREFETCH requests the next step's weights before this step's
products; R > 1 sums runs of R inputs in-thread (fewer accumulators: wider tiles); FLAT (one
row) forms the products in the weights' own 2-D layout rather than a 3-D [rows, N, K] one,
which in the sm_90 SASS drops the byte permutes (benchmark/RESULTS.md, 2026-12-06). One row
runs FLAT with R = 16 by default: the H100 sweep's best at every Qwen3-8B shape, 16-25%
under the earlier 3-D tiles. bench_fp8.py sweeps the variants with the tiles, and
--write-table gives bench_latency.py their best.
"""

from __future__ import annotations

import json

import torch
import triton
import triton.language as tl

from minisgl.kernels import cdiv
from minisgl.kernels.gemv import _rows_rstd, _x_tile, norm_prologue
from minisgl.kernels.pdl import pdl_args, pdl_wait

MAX_ROWS = 4


@triton.jit
def _scaled_x(x_ptr, res_ptr, nw_ptr, offs_m, s_row, m_mask, kk, k_dim, stride_xm, stride_rm,
              rstd, SK: tl.constexpr, ROW_SCALE: tl.constexpr, SILU: tl.constexpr,
              NORM: tl.constexpr):  # fmt: skip
    """The step's activations [BLOCK_M, BLOCK_K] in float32, times their block's scale: the
    x tile as kernels/gemv.py's prologues make it.
    SILU: x is a gated MLP's [gate | up] (each k_dim wide); the activations silu(gate) * up.
    NORM: RMSNorm of x (1) or of x + residual (2), ``rstd`` being the rows' 1 / rms."""
    k_mask = kk < k_dim
    mask = m_mask[:, None] & k_mask[None, :]
    x = _x_tile(
        x_ptr, res_ptr, nw_ptr, offs_m, kk, mask, stride_xm, stride_rm, k_dim, rstd, SILU, NORM
    ).to(tl.float32)
    if not ROW_SCALE:
        x = x * tl.load(s_row + kk // SK, mask=k_mask, other=0.0)[None, :]
    return x


@triton.jit
def _products(x, w, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              R: tl.constexpr, FLAT: tl.constexpr):  # fmt: skip
    """x [BLOCK_M, BLOCK_K] times w [BLOCK_N, BLOCK_K] elementwise, in float32; R > 1: summed
    over runs of R inputs (fewer accumulators where a thread holds R consecutive weights).
    FLAT (one row): [BLOCK_N, BLOCK_K // R] products in the weights' own 2-D layout."""
    if FLAT:
        p = w.to(tl.float32) * tl.reshape(x, [BLOCK_K])[None, :]
        if R > 1:
            p = tl.sum(tl.reshape(p, [BLOCK_N, BLOCK_K // R, R]), axis=2)
    else:
        p = x[:, None, :] * w.to(tl.float32)[None, :, :]
        if R > 1:
            p = tl.sum(tl.reshape(p, [BLOCK_M, BLOCK_N, BLOCK_K // R, R]), axis=3)
    return p


@triton.jit
def _row_sums(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FLAT: tl.constexpr):
    """The accumulators summed over K: [BLOCK_M, BLOCK_N]."""
    if FLAT:
        y = tl.reshape(tl.sum(acc, axis=1), [BLOCK_M, BLOCK_N])
    else:
        y = tl.sum(acc, axis=2)
    return y


@triton.jit(do_not_specialize=["rows"])
def _fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, res_ptr, nw_ptr, res_out_ptr, rows, n_cols, k_dim,
    stride_xm, stride_om, stride_s, stride_rm, eps,
    SN: tl.constexpr, SK: tl.constexpr, ROW_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
    R: tl.constexpr, FLAT: tl.constexpr, SILU: tl.constexpr, PDL: tl.constexpr,
    NORM: tl.constexpr, NORM_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < rows
    n_mask = offs_n < n_cols
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * k_dim
    # Weights, scales and bias are written by no kernel: the first step's weights and the
    # per-row scales are requested before the PDL wait, overlapping the previous kernel.
    w0_mask = n_mask[:, None] & (offs_k < k_dim)[None, :]
    w0 = tl.load(w_rows + offs_k[None, :], mask=w0_mask, other=0.0)
    s_col = tl.zeros([BLOCK_N], tl.float32)
    if ROW_SCALE:
        s_col = tl.load(s_ptr + (offs_n // SN) * stride_s, mask=n_mask, other=0.0)
    bias = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    s_row = s_ptr + (pid * BLOCK_N // SN) * stride_s  # block scales: the program's row
    pdl_wait(PDL)
    rstd = tl.zeros([BLOCK_M], tl.float32)
    if NORM:
        rstd = _rows_rstd(x_ptr, res_ptr, res_out_ptr, offs_m, m_mask, stride_xm, stride_rm,
                          k_dim, eps, pid == 0, BLOCK_M, NORM_K, NORM)  # fmt: skip
    xt = (x_ptr, res_ptr, nw_ptr, offs_m, s_row, m_mask)
    if PREFETCH:  # the next step's weights requested before this step's products
        if FLAT:
            acc = tl.zeros([BLOCK_N, BLOCK_K // R], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // R], tl.float32)
        w = w0
        for k0 in range(0, k_dim, BLOCK_K):
            kn = k0 + BLOCK_K + offs_k
            nxt = tl.load(w_rows + kn[None, :], mask=n_mask[:, None] & (kn < k_dim)[None, :],
                          other=0.0)  # fmt: skip
            x = _scaled_x(*xt, k0 + offs_k, k_dim, stride_xm, stride_rm, rstd, SK, ROW_SCALE,
                          SILU, NORM)  # fmt: skip
            acc += _products(x, w, BLOCK_M, BLOCK_N, BLOCK_K, R, FLAT)
            w = nxt
    else:
        x0 = _scaled_x(*xt, offs_k, k_dim, stride_xm, stride_rm, rstd, SK, ROW_SCALE, SILU,
                       NORM)  # fmt: skip
        acc = _products(x0, w0, BLOCK_M, BLOCK_N, BLOCK_K, R, FLAT)
        for k0 in range(BLOCK_K, k_dim, BLOCK_K):
            kk = k0 + offs_k
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & (kk < k_dim)[None, :],
                        other=0.0)  # fmt: skip
            x = _scaled_x(*xt, kk, k_dim, stride_xm, stride_rm, rstd, SK, ROW_SCALE, SILU,
                          NORM)  # fmt: skip
            acc += _products(x, w, BLOCK_M, BLOCK_N, BLOCK_K, R, FLAT)
    y = _row_sums(acc, BLOCK_M, BLOCK_N, FLAT)
    if ROW_SCALE:
        y = y * s_col[None, :]
    if HAS_BIAS:
        y += bias[None, :]
    dst = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# (BLOCK_N, BLOCK_K, warps, stages, PREFETCH, R, FLAT) as the kernel takes them; FLAT is
# honoured at one row only.
Config = tuple[int, int, int, int, int, int, int]
Tiles = tuple[int, int, int, int, int, int, int, int]  # (BLOCK_M, *Config)

# Configs per (rows, N, K), overriding fp8_gemv_tiles: set by tuning runs
# (benchmark/gpu/bench_fp8.py --write-table, bench_latency.py --fp8-gemv-table).
TABLE: dict[tuple[int, int, int], Config] = {}


def fp8_gemv_tiles(rows: int, n_cols: int, k_dim: int) -> Tiles:
    """The sweeps' best tiles at Qwen3-8B's shapes (benchmark/RESULTS.md): one row FLAT on
    8 x 2048 tiles, 8 warps, runs of 16 inputs (best or within noise of it at every shape);
    2-4 rows the 3-D products on 8 x 1024 tiles."""
    block_m = triton.next_power_of_2(max(rows, 1))
    if (rows, n_cols, k_dim) in TABLE:
        return (block_m, *TABLE[rows, n_cols, k_dim])
    if rows == 1:
        return 1, 8, 2048, 8, 1, 0, 16, 1
    return block_m, 8, 1024, 4, 1, 0, 1, 0


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: Tiles | None = None,
    silu_x: bool = False,
) -> torch.Tensor:
    """x [M, K] (M <= 4) times (weight e4m3 [N, K] with ``scales`` [N/SN, K/SK])^T (+ bias)
    -> [M, N] in x's dtype. Block scales need BLOCK_N to divide SN (the tiles are cut).
    ``silu_x``: x is [M, 2K] [gate | up] and the product is silu(gate) * up's
    (kernels/activation.py's bits), computed on the way in."""
    assert x.shape[1] == (2 * weight.shape[1] if silu_x else weight.shape[1])
    return _launch(x, weight, scales, bias, tiles, silu_x=silu_x)


def fp8_gemv_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: Tiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) W^T (+ bias), x + residual) in one kernel, as
    kernels/gemv.gemv_add_rms_norm makes them (its roundings, its 1 / rms) for an e4m3 W.
    ``residual`` None: the norm of x, and x is returned as the residual."""
    assert norm_weight.dtype == x.dtype and norm_weight.shape == (x.shape[1],)
    assert x.shape[1] == weight.shape[1]
    res_out = torch.empty_like(x) if residual is not None else x
    norm = (norm_weight, eps, res_out)
    return _launch(x, weight, scales, bias, tiles, residual=residual, norm=norm), res_out


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    tiles: Tiles | None,
    silu_x: bool = False,
    residual: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float, torch.Tensor] | None = None,
) -> torch.Tensor:
    rows, n_cols, k_dim = x.shape[0], weight.shape[0], weight.shape[1]
    assert rows <= MAX_ROWS and weight.is_contiguous()
    sn, sk = n_cols // scales.shape[0], k_dim // scales.shape[1]
    assert scales.shape == (n_cols // sn, k_dim // sk) and scales.dtype == torch.float32
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, n_cols, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_m, block_n, block_k, warps, stages, prefetch, r, flat = tiles or fp8_gemv_tiles(
        rows, n_cols, k_dim
    )
    row_scale = sk == k_dim
    if not row_scale:
        block_n = min(block_n, sn & -sn)  # a power of two dividing SN
    res, nw, res_out, mode, nk, eps = norm_prologue(x, k_dim, residual, norm, out)
    _fp8_gemv_kernel[(cdiv(n_cols, block_n),)](
        x, weight, scales, bias if bias is not None else scales, out, res, nw, res_out, rows,
        n_cols, k_dim, x.stride(0), out.stride(0), scales.stride(0), res.stride(0), eps,
        SN=sn, SK=sk, ROW_SCALE=row_scale, HAS_BIAS=bias is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, PREFETCH=prefetch, R=r, FLAT=bool(flat) and block_m == 1,
        SILU=silu_x, NORM=mode, NORM_K=nk, num_warps=warps, num_stages=stages, **pdl_args(),
    )  # fmt: skip
    return out


def load_table(path: str) -> None:
    """Read a JSON list of [rows, N, K, Config] into TABLE."""
    with open(path) as f:
        # Tables written before FLAT existed hold six values.
        TABLE.update(
            {(r, n, k): (*t[:6], t[6] if len(t) > 6 else 0) for r, n, k, t in json.load(f)}
        )
