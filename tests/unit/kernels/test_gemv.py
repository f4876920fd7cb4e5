"""The skinny-GEMM Triton kernel (kernels/gemv.py) against F.linear: 1-4 rows, ragged N and
K, bias, bf16/fp16/fp32, strided rows. Run under Triton's interpreter on CPU (one child
process, see tests/kernel_checks.py) and natively on CUDA under the ``gpu`` marker."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # the interpreter child: make `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests import kernel_checks


def _case(rows: int, n: int, k: int, dtype: torch.dtype, bias: bool, device: torch.device) -> None:
    from minisgl.kernels.gemv import gemv

    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    got = gemv(x.to(device), w.to(device), None if b is None else b.to(device))
    assert got.shape == (rows, n) and got.dtype == dtype
    # float32 accumulation of the same products: only the final rounding to dtype differs.
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float().cpu(), ref, atol=tol, rtol=tol)


def check_gemv_shapes(device: torch.device) -> None:
    for rows in (1, 2, 3, 4):
        _case(rows, 48, 1024, torch.float32, False, device)
    _case(1, 37, 700, torch.float32, True, device)  # N and K off the tile sizes
    _case(3, 130, 513, torch.float32, True, device)


def check_gemv_half_precision(device: torch.device) -> None:
    _case(1, 64, 512, torch.bfloat16, False, device)
    _case(2, 40, 300, torch.float16, True, device)


def check_gemv_strided_rows_and_empty(device: torch.device) -> None:
    from minisgl.kernels.gemv import gemv

    g = torch.Generator().manual_seed(7)
    big = torch.randn(4, 2 * 256, generator=g)
    x = big[:, :256]  # rows strided like a slice of a wider activation
    w = torch.randn(24, 256, generator=g)
    got = gemv(x.to(device), w.to(device))
    torch.testing.assert_close(got.cpu(), x @ w.T, atol=1e-4, rtol=1e-4)
    assert gemv(x[:0].to(device), w.to(device)).shape == (0, 24)


def check_gemv_tile_rule(device: torch.device) -> None:
    """Every branch of gemv_choice gives tiles that compute the product (shapes shrunk)."""
    from minisgl.kernels.gemv import gemv, gemv_choice

    g = torch.Generator().manual_seed(11)
    for n, k in ((40, 3000), (40, 2000), (1030, 8200), (1030, 4100), (1030, 1000), (4100, 1000)):
        tiles = gemv_choice(1, n, k)
        assert tiles is not None and tiles[0] == 1
        x, w = torch.randn(1, k, generator=g), torch.randn(n, k, generator=g) / k**0.5
        got = gemv(x.to(device), w.to(device), None, tiles)
        torch.testing.assert_close(got.cpu(), x @ w.T, atol=1e-4, rtol=1e-4)
    # cuBLAS keeps 2-4 rows and the widest weights (an LM head), where it measured faster.
    assert gemv_choice(2, 1024, 1024) is None and gemv_choice(1, 151936, 1024) is None


def check_gemv_flat_tiles(device: torch.device) -> None:
    """FLAT tiles (one row's products in the weights' 2-D layout) compute the product with
    each prologue; above one row they are ignored."""
    from minisgl.kernels.activation import silu_and_mul
    from minisgl.kernels.gemv import gemv, gemv_add_rms_norm

    g = torch.Generator().manual_seed(13)
    for rows, n, k, tiles in (
        (1, 40, 700, (1, 8, 256, 4, 2, 1)),
        (2, 24, 512, (2, 8, 128, 4, 1, 1)),
    ):
        x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) / k**0.5
        got = gemv(x.to(device), w.to(device), None, tiles)
        torch.testing.assert_close(got.cpu(), x @ w.T, atol=1e-4, rtol=1e-4)
    gate_up, w = torch.randn(1, 2 * 256, generator=g), torch.randn(16, 256, generator=g) / 16
    flat = (1, 4, 128, 4, 1, 1)
    got = gemv(gate_up.to(device), w.to(device), None, flat, silu_x=True)
    want = silu_and_mul(gate_up.to(device)).cpu() @ w.T  # a Triton kernel: on the device
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
    x, res, nw = (torch.randn(1, 256, generator=g) for _ in range(3))
    out, res_out = gemv_add_rms_norm(x.to(device), res.to(device), nw[0].to(device), 1e-6,
                                     w.to(device), None, flat)  # fmt: skip
    h = x + res
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * nw[0]
    torch.testing.assert_close(res_out.cpu(), h)
    torch.testing.assert_close(out.cpu(), normed @ w.T, atol=1e-4, rtol=1e-4)


def check_gemv_silu_mul_prologue(device: torch.device) -> None:
    """silu_x: the GEMV of a gated MLP's [gate | up] equals silu_and_mul then the GEMV, bit
    for bit (16-bit dtypes, 1 row as the model runs it and 3; K off the tile sizes)."""
    from minisgl.kernels.activation import silu_and_mul
    from minisgl.kernels.gemv import gemv, gemv_choice

    g = torch.Generator().manual_seed(5)
    for rows, n, k, dtype in ((1, 64, 700, torch.bfloat16), (3, 40, 256, torch.float16)):
        gate_up = (torch.randn(rows, 2 * k, generator=g) * 3).to(dtype).to(device)
        w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(device)
        tiles = gemv_choice(1, n, k) if rows == 1 else None
        want = gemv(silu_and_mul(gate_up), w, None, tiles)
        got = gemv(gate_up, w, None, tiles, silu_x=True)
        assert got.shape == (rows, n) and torch.equal(got, want)


def check_gemv_rms_norm_prologue(device: torch.device) -> None:
    """gemv_add_rms_norm against kernels/norm.py's fused add + RMSNorm then the GEMV, with and
    without a residual: the new residual bit-equal; through an identity weight (the product
    is then the normalised input itself) at most one bf16 step off, at few inputs (where
    1 / rms, summed in another order, moved a rounding); a random weight within that. The
    sum of squares in one step of the whole row and (steps of 256) in several."""
    from minisgl.kernels import gemv as gemv_module

    cap = gemv_module.MAX_NORM_K
    cases = ((1, 700, True, cap), (1, 700, True, 256), (1, 512, False, cap), (2, 256, True, cap))
    try:
        for rows, k, with_res, max_norm_k in cases:
            gemv_module.MAX_NORM_K = max_norm_k
            _check_norm_prologue(device, rows, k, with_res)
    finally:
        gemv_module.MAX_NORM_K = cap


def _check_norm_prologue(device: torch.device, rows: int, k: int, with_res: bool) -> None:
    from minisgl.kernels.gemv import gemv, gemv_add_rms_norm, gemv_choice
    from minisgl.kernels.norm import fused_add_rms_norm, rms_norm

    g = torch.Generator().manual_seed(9 + k + rows)
    dt = torch.bfloat16
    x = (torch.randn(rows, k, generator=g) * 4).to(dt).to(device)
    res = (torch.randn(rows, k, generator=g) * 4).to(dt).to(device) if with_res else None
    nw = (torch.rand(k, generator=g) + 0.5).to(dt).to(device)
    if res is not None:
        h, want_res = fused_add_rms_norm(x, res, nw, 1e-6)
    else:
        h, want_res = rms_norm(x, nw, 1e-6), x
    for w in (torch.eye(k), torch.randn(48, k, generator=g) / k**0.5):
        w = w.to(dt).to(device)
        tiles = gemv_choice(1, w.shape[0], k) if rows == 1 else None
        want = gemv(h, w, None, tiles).float()
        got, got_res = gemv_add_rms_norm(x, res, nw, 1e-6, w, None, tiles)
        assert torch.equal(got_res, want_res)
        err = (got.float() - want).abs()
        if w.shape[0] == k:  # the normalised input: <= one step at <= 2% of the inputs
            assert bool((err <= want.abs() * 2**-7).all()) and (err > 0).float().mean() < 0.02
        else:  # a few inputs one step off, times their weights; then bf16 rounding
            bound = 4 * ((h.float().abs() * 2**-7)[:, None, :] * w.float().abs()).amax(-1)
            assert bool((err <= bound + want.abs() * 2**-8 + 1e-6).all()), err.max().item()


CHECKS = kernel_checks.collect(globals())


test_interpreted, test_on_gpu = kernel_checks.make_tests(__file__, CHECKS, slow=("gemv_tile_rule",))


if __name__ == "__main__":
    kernel_checks.main(CHECKS)
