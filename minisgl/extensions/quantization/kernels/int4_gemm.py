"""y = x W^T (+ b) with W stored as 4-bit codes: dequantized tile by tile inside the GEMM.

Layout (extensions/quantization/int4.py converts GPTQ and AWQ checkpoints to it at load time):
``qweight`` int32 [K/8, N], nibble j of word (r, n) = code of W[n, 8r + j]; ``scales``
float32 and ``zeros`` uint8 [K/G, N]; W[n, k] = (code - zeros[k // G, n]) * scales[k // G, n].

Each program owns a BLOCK_M x BLOCK_N tile of the output and walks K in BLOCK_K steps:
it loads the [BLOCK_K, BLOCK_N] tile's words (one 32-bit word serves 8 inputs of a column),
shifts out each input's nibble, applies its group's zero and scale in float32, rounds the
weight to x's dtype (so the weights equal a dequantized checkpoint's, rounded to the compute
dtype) and feeds tensor cores with tl.dot, accumulating in float32. Reading 4-bit weights is
a quarter of a bf16 GEMM's weight traffic, which is what bounds decoding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels import cdiv
from minisgl.kernels.pdl import pdl_args, pdl_wait


@triton.jit(do_not_specialize=["rows"])
def _int4_gemm_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr, rows, n_cols, k_dim, stride_xm, stride_om,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < rows
    n_mask = offs_n < n_cols
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < k_dim
        x = tl.load(
            x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + kk[None, :],
            mask=m_mask[:, None] & k_mask[None, :], other=0.0,
        )  # fmt: skip
        kn_mask = k_mask[:, None] & n_mask[None, :]
        words = tl.load(
            qw_ptr + (kk // 8).to(tl.int64)[:, None] * n_cols + offs_n[None, :],
            mask=kn_mask, other=0,
        )  # fmt: skip
        codes = (words >> ((kk % 8) * 4)[:, None]) & 0xF
        grp = (kk // GROUP).to(tl.int64)[:, None] * n_cols + offs_n[None, :]
        scale = tl.load(s_ptr + grp, mask=kn_mask, other=0.0)
        zero = tl.load(z_ptr + grp, mask=kn_mask, other=0).to(tl.int32)
        w = ((codes - zero).to(tl.float32) * scale).to(dtype)
        if UPCAST:  # same values, float32 operands (see int4_gemm)
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:  # float32 inputs: no TF32 rounding (the CPU-equal reference path)
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    dst = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(dst, acc.to(dtype), mask=m_mask[:, None] & n_mask[None, :])


_INTERPRETED = type(_int4_gemm_kernel).__name__ == "InterpretedFunction"


def int4_tiles(rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps): tl.dot needs 16+ on each side; few rows (decode)
    take 16-row tiles and wide N tiles, prefill larger M tiles. Untuned (benchmark/gpu/bench_gemv.py
    --int4 times them)."""
    if rows <= 16:
        return 16, 64, 64, 4
    if rows <= 64:
        return 64, 64, 64, 4
    return 128, 128, 32, 8


def prepare(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checks the int4 weight's shapes against x [M, K]; returns x with unit inner stride and
    the output [M, N] to fill (shared by this GEMM and kernels/int4_gemv.py)."""
    k_dim = x.shape[1]
    n_cols = qweight.shape[1]
    assert qweight.shape[0] * 8 == k_dim and k_dim % group == 0, (x.shape, qweight.shape, group)
    assert scales.shape == zeros.shape == (k_dim // group, n_cols), (scales.shape, zeros.shape)
    if x.stride(1) != 1:
        x = x.contiguous()
    return x, torch.empty(x.shape[0], n_cols, dtype=x.dtype, device=x.device)


def int4_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    bias: torch.Tensor | None = None,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """x [M, K] times the int4 weight (layout above) -> [M, N] in x's dtype (+ bias [N])."""
    x, out = prepare(x, qweight, scales, zeros, group)
    rows, k_dim = x.shape
    n_cols = out.shape[1]
    if rows == 0:
        return out
    block_m, block_n, block_k, warps = tiles or int4_tiles(rows)
    # Triton's interpreter multiplies the raw bits of bf16 tl.dot operands: upcast there.
    upcast = _INTERPRETED and x.dtype != torch.float32
    grid = (cdiv(rows, block_m), cdiv(n_cols, block_n))
    _int4_gemm_kernel[grid](
        x, qweight, scales, zeros, bias if bias is not None else scales, out,
        rows, n_cols, k_dim, x.stride(0), out.stride(0),
        GROUP=group, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32 or upcast,
        UPCAST=upcast,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=3,
        **pdl_args(),
    )  # fmt: skip
    return out
