"""RMSNorm in Triton, optionally fused with the residual add that precedes it.

Rounding follows the torch reference (Hugging Face's order): the residual sum is rounded
to the activation dtype, statistics run in float32, the normalised row is rounded to the
activation dtype, and only then is it multiplied by the weight. Each row's elements must be
contiguous; rows themselves may be strided, either [N, D] or a [T, H, D] per-head view (q/k
norm straight on slices of a fused QKV output, without a copy).

The fused q/k-norm + RoPE + KV-store kernel (qk_rope_store.py) must give the same bits as
q/k norm here: it reduces rows in a tile of the same shape (``row_tile``), and both kernels
are compiled without FMA contraction (RoPE needs that, and a contracted sum of squares
would round differently).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels import cdiv
from minisgl.kernels.pdl import pdl_args, pdl_wait

# Elements one program covers: short rows (q/k norm over head_dim) are packed several to a
# program so each one still moves a useful amount of data.
_TILE = 2048


# The row count changes every batch: specialising on it (== 1, divisible by 16) would
# compile new variants while serving.
@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    n_rows,
    n_cols,
    heads,
    stride_xt,
    stride_xh,
    stride_rt,
    stride_rh,
    eps,
    s_ptr,
    stride_sm,
    stride_sg,
    HAS_RES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QUANT: tl.constexpr,
    PDL: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    # The weight is constant: read before the PDL wait (kernels/pdl.py). Read after the row
    # statistics, it cost one more memory round trip at the end of every norm.
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    # Row r is (token r // heads, head r % heads); plain 2-D input has heads == 1.
    tok = rows // heads
    head = rows % heads
    x_off = (tok * stride_xt + head * stride_xh)[:, None] + cols[None, :]
    out_off = (rows * n_cols)[:, None] + cols[None, :]
    dtype = x_ptr.dtype.element_ty

    x = tl.load(x_ptr + x_off, mask=mask, other=0.0)
    if HAS_RES:
        r_off = (tok * stride_rt + head * stride_rh)[:, None] + cols[None, :]
        r = tl.load(res_ptr + r_off, mask=mask, other=0.0)
        # torch adds half-precision tensors in float32 and rounds once; do the same.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + out_off, x, mask=mask)

    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / n_cols
    rstd = tl.rsqrt(var + eps)
    # Round to the activation dtype before the weight multiply, as the reference does.
    y = (xf * rstd[:, None]).to(dtype).to(tl.float32)
    if QUANT:  # e4m3 out with a float32 scale per 128 columns (`add_rms_norm_quant`)
        y = (y * w[None, :]).to(dtype).to(tl.float32)
        groups = tl.reshape(y, [BLOCK_M, BLOCK_N // 128, 128])
        scale = tl.maximum(tl.max(tl.abs(groups), axis=2), 1e-10) / 448.0
        q = tl.reshape(groups / scale[:, :, None], [BLOCK_M, BLOCK_N])
        tl.store(out_ptr + out_off, q.to(out_ptr.dtype.element_ty), mask=mask)
        g = tl.arange(0, BLOCK_N // 128)
        s_off = rows[:, None] * stride_sm + g[None, :] * stride_sg
        s_mask = (rows < n_rows)[:, None] & (g * 128 < n_cols)[None, :]
        tl.store(s_ptr + s_off, scale, mask=s_mask)
    else:
        tl.store(out_ptr + out_off, (y * w[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


def row_tile(d: int) -> tuple[int, int, int]:
    """(BLOCK_M rows, BLOCK_N columns, num_warps) of the tile that reduces rows of width d.
    Depends on the row width only, so one compiled variant serves every batch size; the
    compiler lays out (and so orders) the sum of squares by this shape and warp count."""
    block_n = triton.next_power_of_2(d)
    block_m = max(1, _TILE // block_n)
    return block_m, block_n, min(16, max(4, block_m * block_n // 1024))


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """Returns (x with unit last stride, heads, token stride, head stride) for the kernel."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 3:
        return x, x.shape[1], x.stride(0), x.stride(1)
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])  # a view whenever the dims allow it
    return x, 1, x.stride(0), 0


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``scales`` [rows (or more), D / 128] (any strides): the output is e4m3, quantized per
    128 columns into them, with as many rows as they have (`add_rms_norm_quant`)."""
    d = x.shape[-1]
    assert weight.shape == (d,) and weight.is_contiguous(), (weight.shape, d)
    assert weight.device == x.device
    # Same dtype rule as `weight * normed` in torch: x.dtype whenever the weight matches it.
    dtype = torch.promote_types(x.dtype, weight.dtype) if scales is None else torch.float8_e4m3fn
    shape = x.shape if scales is None else (scales.shape[0], d)  # padded rows stay unwritten
    out = torch.empty(shape, dtype=dtype, device=x.device)
    res_out = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (
            residual.shape,
            residual.dtype,
        )
        res_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel() == 0:
        return out, res_out

    xk, heads, sxt, sxh = _rows(x)
    rk, srt, srh = xk, 0, 0
    if residual is not None:
        rk, r_heads, srt, srh = _rows(residual)
        assert r_heads == heads
    n_rows = xk.numel() // d
    block_m, block_n, num_warps = row_tile(d)
    grid = (cdiv(n_rows, block_m),)
    _rms_norm_kernel[grid](
        xk, rk, weight, out, res_out if res_out is not None else out,
        n_rows, d, heads, sxt, sxh, srt, srh, eps, scales if scales is not None else weight,
        0 if scales is None else scales.stride(0), 0 if scales is None else scales.stride(1),
        HAS_RES=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        QUANT=scales is not None, num_warps=num_warps,
        # Sum x*x with separate multiplies and adds, as the fused q/k-norm kernel must.
        enable_fp_fusion=False, **pdl_args(),
    )  # fmt: skip
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` ([N, D], or a [T, H, D] per-head view); a new,
    contiguous tensor of x's shape."""
    out, _ = _launch(x, None, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rmsnorm(x + residual) * weight, x + residual) from one pass over memory."""
    out, res_out = _launch(x, residual, weight, eps)
    assert res_out is not None
    return out, res_out


def add_rms_norm_quant(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    column_major: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 q, float32 scales [N, D/128], x + residual (x without one)): the normed rows
    of `fused_add_rms_norm` (their bits) quantized per 128 columns as an FP8 GEMM's
    activation quantizer does it (dynamic: scale = the group's max-abs / 448), in the norm's
    pass over memory. x [N, D], D % 128 == 0. ``column_major``: cuBLASLt's layout, the
    scales' N stride 1 and q and the scales with N rounded up to a multiple of 4 (the pad
    rows unwritten; see extensions/quantization/kernels/fp8_gemm.cublas_rows)."""
    rows, d = x.shape
    assert d % 128 == 0 and x.dtype == weight.dtype
    padded = -(-rows // 4) * 4 if column_major else rows
    s = torch.empty((d // 128, padded) if column_major else (padded, d // 128), dtype=torch.float32,
                    device=x.device)  # fmt: skip
    s = s.t() if column_major else s
    q, res_out = _launch(x, residual, weight, eps, s)
    return q, s, x if res_out is None else res_out
