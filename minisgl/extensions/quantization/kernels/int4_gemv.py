"""Batch-1 int4 GEMV (1-4 rows): y = x W^T (+ b) with W in the layout of kernels/int4_gemm.py.

``qweight`` int32 [K/8, N] (nibble j of word (r, n) = code of W[n, 8r + j]), ``scales``
float32 and ``zeros`` uint8 [K/G, N]; W[n, k] = (code - zero) * scale, rounded to x's dtype.

Decoding at batch 1 reads every weight once, so the product should stream the packed words
at HBM bandwidth; a tensor-core GEMM tile of 16+ rows wastes most of its work on one row.
Each program owns BLOCK_N output columns for every row and streams their words over all of
K, BLOCK_K inputs (BLOCK_K/8 words per column, coalesced along N) per step, accumulating
elementwise in float32 and reducing over K once, at the end (as in kernels/gemv.py).

Why this design (the first version ran 2-3x slower than bf16 cuBLAS on the H200, although
it reads 4x fewer bytes; this one is 1.8-2.4x faster than it, benchmark/RESULTS.md):
- Bytes in flight. The first version shortened its K step to one group (128 inputs: a 1 KB
  tile of words for 16 columns) and waited for each tile before requesting the next, so it
  paid one memory latency (~1 us) per 128 inputs (36 us for 4096 inputs). This one keeps
  whole groups in a step (a tile is [words of a group, groups, columns]: scales broadcast
  along the first axis, no gather), 512-1024 inputs per step, and requests the next step's
  words before computing on the current ones (two tiles in flight per program).
- Instructions per weight. One accumulator per row in the words' own layout (the first
  version's [rows, K/8, N] accumulator made Triton convert layouts); the nibble becomes
  (code - zero) in float32 with no int-to-float conversion ((code | 0x4B000000) is the float
  2^23 + code, and 2^23 + zero is computed once per group), and on the GPU the rounding to
  bf16/fp16 takes one packed cvt.rn.{bf16,f16}x2.f32 per two weights (inline PTX; Triton's
  .to() emits one slow F2F per weight); the interpreter keeps .to(). Both round to nearest
  even: the weights are bit-identical to the GEMM's ((code - zero) in float32 * scale,
  rounded to x's dtype; only the summation order differs).

Scales and zeros: a step of whole groups (group divides BLOCK_K) reads each group's once per
step; a step inside one group (BLOCK_K divides the group) once per step; one group over all
of K once per program; any other group size (e.g. 24) per word.

Tiles are untuned: benchmark/gpu/bench_gemv.py --int4 [--int4-sweep] times them against the
int4 GEMM and bf16 cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.extensions.quantization.kernels.int4_gemm import prepare
from minisgl.kernels import cdiv
from minisgl.kernels.pdl import pdl_args, pdl_wait

MAX_ROWS = 4

# How a tile finds its scales and zeros (constexpr MODE of the kernels).
ONE_GROUP = 0  # one group over all of K: loaded once per program
PER_TILE = 1  # each BLOCK_K tile lies in one group: loaded once per tile
PER_WORD = 2  # gathered per word (all 8 inputs of a word share a group)
PER_GROUP = 3  # a tile of whole groups (the group divides BLOCK_K): once per group


@triton.jit
def _step_words(qw_ptr, k0, k_dim, n_cols, offs_n, n_mask, GPT: tl.constexpr, WPG: tl.constexpr):
    """The words of the step from input k0: [WPG, GPT, BLOCK_N], word row k0/8 + g*WPG + w."""
    kw = k0 // 8 + tl.arange(0, WPG)[:, None] + tl.arange(0, GPT)[None, :] * WPG
    mask = (kw < k_dim // 8)[:, :, None] & n_mask[None, None, :]
    ptr = qw_ptr + kw.to(tl.int64)[:, :, None] * n_cols + offs_n[None, None, :]
    return tl.load(ptr, mask=mask, other=0)


@triton.jit
def _round_weight(w, dtype: tl.constexpr, ASM: tl.constexpr):
    """w (float32) rounded to nearest even in dtype, back in float32 (exact)."""
    if dtype == tl.float32:
        return w
    if ASM:  # one packed conversion per two weights ($1 goes to the low half)
        if dtype == tl.bfloat16:
            r = tl.inline_asm_elementwise(
                "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [w], dtype=tl.bfloat16,
                is_pure=True, pack=2,
            )  # fmt: skip
        else:
            r = tl.inline_asm_elementwise(
                "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [w], dtype=tl.float16,
                is_pure=True, pack=2,
            )  # fmt: skip
        return r.to(tl.float32)
    return w.to(dtype).to(tl.float32)


@triton.jit
def _step_products(
    acc0, acc1, acc2, acc3, words, x_ptr, stride_xm, rows, s_ptr, z_ptr, s_one, zc_one,
    k0, k_dim, n_cols, offs_n, n_mask,
    GROUP: tl.constexpr, MODE: tl.constexpr, GPT: tl.constexpr, WPG: tl.constexpr,
    BLOCK_M: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """acc_r += the products of row r with the step from input k0, whose words are loaded."""
    dtype = x_ptr.dtype.element_ty
    kw = k0 // 8 + tl.arange(0, WPG)[:, None] + tl.arange(0, GPT)[None, :] * WPG  # [WPG, GPT]
    kw_mask = kw < k_dim // 8
    if MODE == 0:  # ONE_GROUP: loaded once, [1, BLOCK_N]
        scale = s_one[None, :, :]
        zc = zc_one[None, :, :]
    elif MODE == 2:  # PER_WORD: [WPG, 1, BLOCK_N]
        w_mask = kw_mask[:, :, None] & n_mask[None, None, :]
        grp = (kw * 8 // GROUP).to(tl.int64)[:, :, None] * n_cols + offs_n[None, None, :]
        scale = tl.load(s_ptr + grp, mask=w_mask, other=0.0)
        zero = tl.load(z_ptr + grp, mask=w_mask, other=0).to(tl.int32)
        zc = (zero | 0x4B000000).to(tl.float32, bitcast=True)
    else:  # PER_TILE (GPT == 1) or PER_GROUP
        # Loaded in the words' [WPG, GPT, BLOCK_N] shape (each thread its rows' copy, L1
        # hits), so that Triton gives them the words' layout: a [GPT, BLOCK_N] load of
        # 128+ elements gets a layout of its own and a shared-memory conversion per step.
        g = k0 // GROUP + tl.arange(0, GPT)
        g_mask = (g < k_dim // GROUP)[None, :, None] & n_mask[None, None, :]
        g_mask = g_mask & (tl.arange(0, WPG) >= 0)[:, None, None]
        offs_n4 = tl.max_contiguous(offs_n, 4)  # zeros: 4 bytes a thread, like the words
        grp = (g.to(tl.int64) * n_cols)[None, :, None] + offs_n4[None, None, :]
        grp = grp + tl.zeros([WPG, 1, 1], tl.int64)
        scale = tl.load(s_ptr + grp, mask=g_mask, other=0.0)
        zero = tl.load(z_ptr + grp, mask=g_mask, other=0).to(tl.int32)
        zc = (zero | 0x4B000000).to(tl.float32, bitcast=True)  # 2^23 + zero
    x0 = x_ptr + kw * 8
    for j in tl.static_range(8):
        # 2^23 + code as a float (exact), minus 2^23 + zero: code - zero in float32, exact.
        t = (((words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
        # The GEMM's dequantization: (code - zero) * scale in float32, rounded to x's dtype.
        w = _round_weight((t - zc) * scale, dtype, ASM)
        x = tl.load(x0 + j, mask=kw_mask, other=0.0).to(tl.float32)
        acc0 += x[:, :, None] * w
        if BLOCK_M > 1:
            x = tl.load(x0 + (stride_xm + j), mask=kw_mask & (kw * 0 + 1 < rows), other=0.0)
            acc1 += x.to(tl.float32)[:, :, None] * w
        if BLOCK_M > 2:
            x = tl.load(x0 + (2 * stride_xm + j), mask=kw_mask & (kw * 0 + 2 < rows), other=0.0)
            acc2 += x.to(tl.float32)[:, :, None] * w
            x = tl.load(x0 + (3 * stride_xm + j), mask=kw_mask & (kw * 0 + 3 < rows), other=0.0)
            acc3 += x.to(tl.float32)[:, :, None] * w
    return acc0, acc1, acc2, acc3


@triton.jit
def _store_row(
    acc, r: tl.constexpr, rows, b_ptr, out_ptr, stride_om, offs_n, n_mask, HAS_BIAS: tl.constexpr
):
    y = tl.sum(tl.sum(acc, axis=1), axis=0)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    dst = out_ptr + r * stride_om + offs_n
    tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=n_mask & (offs_n * 0 + r < rows))


@triton.jit(do_not_specialize=["rows"])
def _int4_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr, rows, n_cols, k_dim, stride_xm, stride_om,
    GROUP: tl.constexpr, MODE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    ASM: tl.constexpr,
):  # fmt: skip
    # A step is [WPG, GPT] words a column: GPT groups of WPG words (one group where the
    # step lies inside one, or in PER_WORD mode).
    GPT: tl.constexpr = BLOCK_K // GROUP if MODE == 3 else 1
    WPG: tl.constexpr = BLOCK_K // 8 // GPT
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_cols
    # No kernel writes the weights, scales or zeros: the first step's words (and a single
    # group's scales and zeros) are requested before waiting for the previous kernel
    # (programmatic dependent launch), so their latency overlaps its tail, as in gemv.py.
    words = _step_words(qw_ptr, 0, k_dim, n_cols, offs_n, n_mask, GPT, WPG)
    if MODE == 0:
        s_one = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
        z_one = tl.load(z_ptr + offs_n, mask=n_mask, other=0).to(tl.int32)[None, :]
        zc_one = (z_one | 0x4B000000).to(tl.float32, bitcast=True)
    else:
        s_one = tl.zeros([1, BLOCK_N], tl.float32)
        zc_one = tl.zeros([1, BLOCK_N], tl.float32)
    pdl_wait(PDL)
    acc0 = tl.zeros([WPG, GPT, BLOCK_N], tl.float32)
    acc1 = tl.zeros([WPG, GPT, BLOCK_N], tl.float32)
    acc2 = tl.zeros([WPG, GPT, BLOCK_N], tl.float32)
    acc3 = tl.zeros([WPG, GPT, BLOCK_N], tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        # The next step's words first: two steps' words in flight while this one computes.
        nxt = _step_words(qw_ptr, k0 + BLOCK_K, k_dim, n_cols, offs_n, n_mask, GPT, WPG)
        acc0, acc1, acc2, acc3 = _step_products(
            acc0, acc1, acc2, acc3, words, x_ptr, stride_xm, rows, s_ptr, z_ptr, s_one,
            zc_one, k0, k_dim, n_cols, offs_n, n_mask, GROUP, MODE, GPT, WPG, BLOCK_M, ASM,
        )  # fmt: skip
        words = nxt
    _store_row(acc0, 0, rows, b_ptr, out_ptr, stride_om, offs_n, n_mask, HAS_BIAS)
    if BLOCK_M > 1:
        _store_row(acc1, 1, rows, b_ptr, out_ptr, stride_om, offs_n, n_mask, HAS_BIAS)
    if BLOCK_M > 2:
        _store_row(acc2, 2, rows, b_ptr, out_ptr, stride_om, offs_n, n_mask, HAS_BIAS)
        _store_row(acc3, 3, rows, b_ptr, out_ptr, stride_om, offs_n, n_mask, HAS_BIAS)


# Triton's interpreter has no inline PTX: it rounds with .to() (the same values).
_INTERPRETED = type(_int4_gemv_kernel).__name__ == "InterpretedFunction"

Tiles = tuple[int, int, int, int, int]  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)


# (BLOCK_N, BLOCK_K, warps, stages) for every int4 GEMV launch, BLOCK_M staying the rows'
# power of two: set by tuning runs (benchmark/offline/bench_latency.py --int4-gemv-tiles).
TILES_OVERRIDE: tuple[int, int, int, int] | None = None


def int4_gemv_tiles(rows: int, n_cols: int = 0, k_dim: int = 0) -> Tiles:
    """Default tiles, UNMEASURED (chosen by arithmetic, not on a GPU): 512 inputs (64 words a
    column) per step, 4 warps, 32 columns for one row (an 8 KB tile of words, two in flight
    per program, 16 words a thread; 128 registers in the sm_90 AOT compile), 16 for 2-4 rows
    (four accumulators). The H200 sweep of bench_gemv.py --int4 replaces this (n_cols and
    k_dim are there for a per-shape rule)."""
    block_m = triton.next_power_of_2(max(rows, 1))
    if TILES_OVERRIDE is not None:
        return (block_m, *TILES_OVERRIDE)
    return block_m, 32 if block_m == 1 else 16, 512, 4, 1


def scale_mode(group: int, k_dim: int, block_k: int) -> int:
    """How the kernel reads scales and zeros (its MODE) for this group size and K step."""
    if group >= k_dim:
        return ONE_GROUP
    if group % block_k == 0:
        return PER_TILE  # a step lies in one group
    return PER_GROUP if block_k % group == 0 else PER_WORD


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
    # No step longer than K, nor of 32+ words a column per thread: Triton gives a load of as
    # many elements as threads (x's [BLOCK_K/8] per nibble) a layout of its own, and
    # converting it to the words' layout would cost a shared-memory round trip per nibble.
    block_k = max(8, min(block_k, triton.next_power_of_2(k_dim), 128 * warps))
    mode = scale_mode(group, k_dim, block_k)
    args = (
        x, qweight, scales, zeros, bias if bias is not None else scales, out,
        rows, n_cols, k_dim, x.stride(0), out.stride(0),
    )  # fmt: skip
    meta = dict(
        GROUP=group, MODE=mode, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        **pdl_args(),
    )  # fmt: skip
    _int4_gemv_kernel[(cdiv(n_cols, block_n),)](*args, **meta, ASM=not _INTERPRETED)
    return out
