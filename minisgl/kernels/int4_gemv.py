"""Batch-1 int4 GEMV (1-4 rows): y = x W^T (+ b) with W in the layout of kernels/int4_gemm.py.

``qweight`` int32 [K/8, N] (nibble j of word (r, n) = code of W[n, 8r + j]), ``scales``
float32 and ``zeros`` uint8 [K/G, N]; W[n, k] = (code - zero) * scale, rounded to x's dtype.

Decoding at batch 1 reads every weight once, so the product should stream the packed words
at HBM bandwidth; a tensor-core GEMM tile of 16+ rows wastes most of its work on one row.
Each program owns BLOCK_N output columns for every row and streams their words over all of
K, BLOCK_K inputs (BLOCK_K/8 words per column, coalesced along N) per step. A word holds 8
consecutive inputs of a column: the kernel shifts out nibble j of every word of the tile at
once, so the 8 nibbles are 8 elementwise [BLOCK_K/8, BLOCK_N] updates of one float32
accumulator [rows, BLOCK_K/8, BLOCK_N], each against the inputs 8r + j of x; the
accumulator is reduced over K once, at the end (as in kernels/gemv.py).

Each weight is dequantized exactly as the GEMM does it, ((code - zero) in float32 * scale)
rounded to x's dtype, so both kernels multiply by the same weights; only the summation
order differs. Scales and zeros are read once per group where the tiles allow (group size
a multiple of BLOCK_K, or a divisor of it: the K step shortens to one group; one group
over all of K: read once per program), otherwise per word (a group size that neither
divides nor is divided by BLOCK_K, e.g. 200; all of a word's 8 inputs share a group, as
group sizes are multiples of 8).

Untuned: the default tiles are unmeasured (see int4_gemv_tiles); benchmark/gpu/
bench_gemv.py --int4 times it against the int4 GEMM and bf16 cuBLAS.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from minisgl.kernels import GemvTiles, cdiv
from minisgl.kernels.int4_gemm import prepare
from minisgl.kernels.pdl import pdl_args, pdl_wait

MAX_ROWS = 4

# How a tile finds its scales and zeros (constexpr MODE of the kernel).
ONE_GROUP = 0  # one group over all of K: loaded once per program
PER_TILE = 1  # each BLOCK_K tile lies in one group: loaded once per tile
PER_WORD = 2  # gathered per word (all 8 inputs of a word share a group)


@triton.jit
def _int4_tile(
    acc, words, x_rows, s_ptr, z_ptr, s_one, z_one, k0, k_dim, n_cols, offs_n, n_mask, m_mask,
    GROUP: tl.constexpr, MODE: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """acc += the products of the BLOCK_K inputs from k0, whose words are loaded."""
    dtype = x_rows.dtype.element_ty
    kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # word rows of this tile
    kw_mask = kw < k_dim // 8
    if MODE == 0:  # ONE_GROUP
        scale = s_one[None, :]
        zero = z_one[None, :]
    elif MODE == 1:  # PER_TILE
        g_mask = n_mask & (k0 + tl.zeros_like(offs_n) < k_dim)  # a [BLOCK_N] mask
        grp = tl.cast(k0 // GROUP, tl.int64) * n_cols + offs_n
        scale = tl.load(s_ptr + grp, mask=g_mask, other=0.0)[None, :]
        zero = tl.load(z_ptr + grp, mask=g_mask, other=0).to(tl.int32)[None, :]
    else:  # PER_WORD
        w_mask = kw_mask[:, None] & n_mask[None, :]
        grp = (kw * 8 // GROUP).to(tl.int64)[:, None] * n_cols + offs_n[None, :]
        scale = tl.load(s_ptr + grp, mask=w_mask, other=0.0)
        zero = tl.load(z_ptr + grp, mask=w_mask, other=0).to(tl.int32)
    x_mask = m_mask[:, None] & kw_mask[None, :]
    for j in tl.static_range(8):
        codes = (words >> (4 * j)) & 0xF
        # The GEMM's dequantization, operation for operation (identical weights).
        w = ((codes - zero).to(tl.float32) * scale).to(dtype).to(tl.float32)
        x = tl.load(x_rows[:, None] + (kw * 8 + j)[None, :], mask=x_mask, other=0.0)
        acc += x.to(tl.float32)[:, :, None] * w[None, :, :]
    return acc


@triton.jit
def _load_words(qw_ptr, k0, k_dim, n_cols, offs_n, n_mask, BLOCK_K: tl.constexpr):
    kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    mask = (kw < k_dim // 8)[:, None] & n_mask[None, :]
    return tl.load(qw_ptr + kw.to(tl.int64)[:, None] * n_cols + offs_n[None, :], mask=mask, other=0)


@triton.jit(do_not_specialize=["rows"])
def _int4_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr, rows, n_cols, k_dim, stride_xm, stride_om,
    GROUP: tl.constexpr, MODE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < rows
    n_mask = offs_n < n_cols
    # No kernel writes the weights, scales or zeros: the first tile's words (and a single
    # group's scales and zeros) are requested before waiting for the previous kernel
    # (programmatic dependent launch), so their latency overlaps its tail, as in gemv.py.
    first_words = _load_words(qw_ptr, 0, k_dim, n_cols, offs_n, n_mask, BLOCK_K)
    if MODE == 0:
        s_one = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)
        z_one = tl.load(z_ptr + offs_n, mask=n_mask, other=0).to(tl.int32)
    else:
        s_one = tl.zeros([BLOCK_N], tl.float32)
        z_one = tl.zeros([BLOCK_N], tl.int32)
    pdl_wait(PDL)
    x_rows = x_ptr + offs_m.to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_K // 8, BLOCK_N], tl.float32)
    acc = _int4_tile(
        acc, first_words, x_rows, s_ptr, z_ptr, s_one, z_one, 0, k_dim, n_cols, offs_n,
        n_mask, m_mask, GROUP, MODE, BLOCK_K,
    )  # fmt: skip
    for k0 in range(BLOCK_K, k_dim, BLOCK_K):
        words = _load_words(qw_ptr, k0, k_dim, n_cols, offs_n, n_mask, BLOCK_K)
        acc = _int4_tile(
            acc, words, x_rows, s_ptr, z_ptr, s_one, z_one, k0, k_dim, n_cols, offs_n,
            n_mask, m_mask, GROUP, MODE, BLOCK_K,
        )  # fmt: skip
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    dst = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


Tiles = GemvTiles  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)


def _env_tiles() -> tuple[int, int, int, int] | None:
    """MINISGL_INT4_GEMV_TILES="BLOCK_N,BLOCK_K,warps,stages": every int4 GEMV launch uses
    these (for tuning runs of the whole engine; BLOCK_M stays the rows' power of two)."""
    spec = os.environ.get("MINISGL_INT4_GEMV_TILES", "")
    if not spec:
        return None
    bn, bk, warps, stages = (int(v) for v in spec.split(","))
    return bn, bk, warps, stages


ENV_TILES = _env_tiles()


def int4_gemv_tiles(rows: int, n_cols: int = 0, k_dim: int = 0) -> Tiles:
    """Default tiles. UNMEASURED (chosen by arithmetic, not on a GPU): 16 columns per
    program (a 64-byte run of words per K row) and 512 inputs (64 words) per K step, 4 warps:
    a [64, 16] tile of words, 4 KB in flight per step, and at most 4 x 64 x 16 float32
    accumulators (32 registers a thread). The H200 sweep of bench_gemv.py --int4 replaces
    this (n_cols and k_dim are there for a per-shape rule)."""
    block_m = triton.next_power_of_2(max(rows, 1))
    if ENV_TILES is not None:
        return (block_m, *ENV_TILES)
    return block_m, 16, 512, 4, 3


def scale_mode(group: int, k_dim: int, block_k: int) -> tuple[int, int]:
    """(MODE, K step): how the kernel reads scales and zeros for this group size and K tile.
    A group smaller than the tile that divides it (32 inputs or more) shortens the step to
    one group; unrolling sub-tiles of one group each instead took ptxas minutes (8+ of them).
    """
    if group >= k_dim:
        return ONE_GROUP, block_k
    if group % block_k == 0:
        return PER_TILE, block_k  # a tile lies in one group
    if block_k % group == 0 and group >= 32:
        return PER_TILE, group  # a step of one group (4+ words a column)
    return PER_WORD, block_k


def int4_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    bias: torch.Tensor | None = None,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= 4) times the int4 weight -> [M, N] in x's dtype (+ bias [N]).
    ``tiles``: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), BLOCK_M a power of two >= M,
    BLOCK_N and BLOCK_K powers of two, BLOCK_K >= 8; default int4_gemv_tiles."""
    assert x.shape[0] <= MAX_ROWS, x.shape
    x, out = prepare(x, qweight, scales, zeros, group)
    rows, k_dim = x.shape
    n_cols = out.shape[1]
    if rows == 0:
        return out
    block_m, block_n, block_k, warps, stages = tiles or int4_gemv_tiles(rows, n_cols, k_dim)
    assert block_m >= rows and block_k >= 8, (tiles, rows)
    mode, block_k = scale_mode(group, k_dim, block_k)
    _int4_gemv_kernel[(cdiv(n_cols, block_n),)](
        x, qweight, scales, zeros, bias if bias is not None else scales, out,
        rows, n_cols, k_dim, x.stride(0), out.stride(0),
        GROUP=group, MODE=mode, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        **pdl_args(),
    )  # fmt: skip
    return out
