"""Weight-only FP8 products of 1-16 rows on tensor cores: y = x W^T (+ b), W = e4m3 [N, K]
times float32 scales [N / SN, K / SK] (as kernels/fp8_gemv.py takes them).

Why not CUDA cores: kernels/fp8_gemv.py converts every weight e4m3 -> float16 -> float32
before its FMA, and those conversions, not memory, bound it: it takes about the same time
on an H100 (3.35 TB/s) as on an H200 (4.8 TB/s), 2.0-2.6 TB/s on both (benchmark/RESULTS.md).
Here the weights become float16 (one hardware ``cvt`` per pair, or bit moves that give
value / 256: kernels/fp8_kv.py) and a float16 dot on tensor cores multiplies them, float32
accumulated. The product is computed transposed, out^T = W x^T, so the weight tile is the
dot's wide operand and the 1-16 rows are padded to the dot's minimum of 16 columns.

MODE 0 (W8A8) instead quantizes x per row and 128 inputs in the kernel, as the W8A8 GEMM
does, and feeds the e4m3 weights to an e4m3 dot unconverted. Otherwise x stays weight-only
(no activation quantization): each row is divided by its max-abs before
it becomes float16 (x's own dtype may exceed float16's range), and the sums are multiplied
back. Block scales multiply each step's float32 partial dot (a program's rows read their own
block's scale), per-row scales the final sums.
"""

from __future__ import annotations

import json

import torch
import triton
import triton.language as tl

from minisgl.kernels import cdiv
from minisgl.kernels.fp8_kv import BITS_ASM, E4M3_BITS_FACTOR, _interpreted, fp8_tile_as_f16
from minisgl.kernels.pdl import pdl_args, pdl_wait

MAX_ROWS = 16
W8A8: tl.constexpr = tl.constexpr(0)  # MODE 0: the e4m3 weights straight into an e4m3 dot


@triton.jit(do_not_specialize=["rows"])
def _fp8_gemv_tc_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, rows, n_cols, k_dim, stride_xm, stride_om, stride_s,
    out_mul, SN: tl.constexpr, SK: tl.constexpr, ROW_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MODE: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < n_cols
    m_mask = offs_m < rows
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * k_dim + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # x^T: [BLOCK_K, BLOCK_M]
    s_rows = s_ptr + (offs_n // SN) * stride_s
    s_col = tl.zeros([BLOCK_N], tl.float32)
    if ROW_SCALE:  # weights' scales: written by no kernel, read before the PDL wait
        s_col = tl.load(s_rows, mask=n_mask, other=0.0)
    pdl_wait(PDL)
    amax = tl.full([BLOCK_M], 1.0, tl.float32)
    if MODE != W8A8:
        amax = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, k_dim, BLOCK_K):  # each row's max-abs (x is small: L1/L2 hits)
            xt = tl.load(x_ptrs + k0, mask=m_mask[None, :], other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(xt), axis=0))
        amax = tl.where(amax > 0, amax, 1.0)
    inv = 1.0 / amax
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        w = tl.load(w_ptrs + k0, mask=n_mask[:, None])  # rows past N: never stored
        xt = tl.load(x_ptrs + k0, mask=m_mask[None, :], other=0.0).to(tl.float32)
        if MODE == W8A8:  # x quantized per row and 128 inputs, as fp8_gemm.quantize_groups
            xs = tl.maximum(tl.max(tl.abs(xt), axis=0), 1e-10) / 448.0
            part = tl.dot(w, (xt / xs[None, :]).to(tl.float8e4nv)) * xs[None, :]
        else:
            part = tl.dot(fp8_tile_as_f16(w, False, MODE, ASM), (xt * inv[None, :]).to(tl.float16))
        if ROW_SCALE:
            acc += part
        else:
            acc += part * tl.load(s_rows + k0 // SK, mask=n_mask, other=0.0)[:, None]
    y = acc * (amax * out_mul)[None, :]
    if ROW_SCALE:
        y = y * s_col[:, None]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    dst = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


# (BLOCK_N, BLOCK_K, warps, stages, MODE): MODE 0 (W8A8) or fp8_kv.py's CVT / BITS_ASM.
Tiles = tuple[int, int, int, int, int]


# Tiles per (N, K), overriding the defaults: set by tuning runs (bench_fp8.py --tc
# --write-tc-table, bench_latency.py --fp8-tc-table).
TABLE: dict[tuple[int, int], Tiles] = {}


def fp8_gemv_tc_tiles(rows: int, n_cols: int, k_dim: int) -> Tiles:
    """UNMEASURED defaults (benchmark/gpu/bench_fp8.py --tc sweeps them): W8A8 on 64-row
    weight tiles, the one form whose sm_90 code (Triton, compiled without a GPU) streams the
    e4m3 tiles by cp.async straight into e4m3 wgmma, with no conversion of the weights."""
    return TABLE.get((n_cols, k_dim), (64, 128, 4, 4, 0))


def load_table(path: str) -> None:
    """Read a JSON list of [N, K, Tiles] into TABLE."""
    with open(path) as f:
        TABLE.update({(n, k): (t[0], t[1], t[2], t[3], t[4]) for n, k, t in json.load(f)})


def fp8_gemv_tc(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= 16, 16-bit or float32) times (weight e4m3 [N, K] with ``scales``
    [N/SN, K/SK])^T (+ bias) -> [M, N] in x's dtype. K in whole BLOCK_K steps."""
    rows, k_dim = x.shape
    n_cols = weight.shape[0]
    assert rows <= MAX_ROWS and weight.shape[1] == k_dim and weight.is_contiguous()
    sn, sk = n_cols // scales.shape[0], k_dim // scales.shape[1]
    assert scales.shape == (n_cols // sn, k_dim // sk) and scales.dtype == torch.float32
    block_n, block_k, warps, stages, mode = tiles or fp8_gemv_tc_tiles(rows, n_cols, k_dim)
    # Steps inside one scale block; W8A8: one step per activation group of 128.
    block_k = 128 if mode == 0 else min(block_k, sk & -sk)
    assert k_dim % block_k == 0 and block_k >= 16, (k_dim, block_k)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, n_cols, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    asm = not _interpreted()
    out_mul = E4M3_BITS_FACTOR if mode == BITS_ASM else 1.0
    _fp8_gemv_tc_kernel[(cdiv(n_cols, block_n),)](
        x, weight if mode == 0 else weight.view(torch.uint8), scales, bias if bias is not None else scales, out, rows,
        n_cols, k_dim, x.stride(0), out.stride(0), scales.stride(0), out_mul, SN=sn, SK=sk,
        ROW_SCALE=sk == k_dim, HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=block_n,
        BLOCK_K=block_k, MODE=mode, ASM=asm, num_warps=warps, num_stages=stages, **pdl_args(),
    )  # fmt: skip
    return out
