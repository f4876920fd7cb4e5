"""The int4 GEMM Triton kernel (kernels/int4_gemm.py) against a plain torch dequantize-then-
matmul: 1-16 rows and prefill-sized ones, several group sizes, odd N, bias, fp32/bf16/fp16.
Run under Triton's interpreter on CPU (one child process, see tests/kernel_checks.py) and
natively on CUDA under the ``gpu`` marker."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # the interpreter child: make `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests import kernel_checks


def _weights(
    n: int, k: int, group: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Canonical-layout weights (qweight [K/8, N], scales, zeros [K/G, N]) and the float32
    W [N, K] they stand for, computed element by element from the codes, not the packing."""
    from minisgl.layers.quantized import pack_canonical

    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    zeros = torch.randint(0, 17, (k // group, n), generator=g, dtype=torch.uint8)
    scales = (torch.rand(k // group, n, generator=g) * 0.02 + 0.001).half().float()
    zk = zeros.float().repeat_interleave(group, 0).t()
    sk = scales.repeat_interleave(group, 0).t()
    w = (codes.float() - zk) * sk
    return pack_canonical(codes), scales, zeros, w


def _case(
    rows: int, n: int, k: int, group: int, dtype: torch.dtype, bias: bool, dev: torch.device,
    tiles: tuple[int, int, int, int] | None = None,
) -> None:  # fmt: skip
    from minisgl.kernels.int4_gemm import int4_gemm

    qw, scales, zeros, w = _weights(n, k, group, rows * 7 + n + k + group)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(rows, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    # Reference: the weights rounded to the compute dtype (as the kernel feeds its dot),
    # the product in float32.
    ref = x.float() @ w.to(dtype).float().T
    if b is not None:
        ref += b.float()
    got = int4_gemm(
        x.to(dev), qw.to(dev), scales.to(dev), zeros.to(dev), group,
        None if b is None else b.to(dev), tiles,
    )  # fmt: skip
    assert got.shape == (rows, n) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().cpu(), ref, atol=tol, rtol=tol)


def check_int4_rows_1_to_16(device: torch.device) -> None:
    for rows in (1, 2, 3, 5, 8, 13, 16):
        _case(rows, 72, 256, 32, torch.float32, False, device)


def check_int4_group_sizes_and_odd_n(device: torch.device) -> None:
    for group in (8, 32, 64, 128):
        _case(3, 37, 256, group, torch.float32, True, device)  # N off the tile, bias
    _case(4, 129, 384, 128, torch.float32, False, device)
    _case(2, 40, 200, 200, torch.float32, False, device)  # one group over all of K (-1)
    _case(1, 33, 104, 8, torch.float32, False, device)  # K off the BLOCK_K tile


def check_int4_half_precision(device: torch.device) -> None:
    _case(1, 96, 256, 64, torch.bfloat16, False, device)
    _case(7, 50, 128, 32, torch.float16, True, device)


def check_int4_prefill_tiles(device: torch.device) -> None:
    """The 64- and 128-row tile choices (rows off their tiles) and explicit tiles."""
    _case(40, 70, 128, 32, torch.float32, False, device)
    _case(130, 130, 96, 32, torch.float32, True, device)
    _case(3, 33, 128, 32, torch.float32, False, device, tiles=(16, 32, 16, 4))


def check_int4_strided_rows_and_empty(device: torch.device) -> None:
    from minisgl.kernels.int4_gemm import int4_gemm

    qw, scales, zeros, w = _weights(24, 128, 32, 3)
    big = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
    x = big[:, :128]  # rows strided like a slice of a wider activation
    got = int4_gemm(x.to(device), qw.to(device), scales.to(device), zeros.to(device), 32)
    torch.testing.assert_close(got.cpu(), x @ w.T, atol=1e-4, rtol=1e-4)
    empty = int4_gemm(x[:0].to(device), qw.to(device), scales.to(device), zeros.to(device), 32)
    assert empty.shape == (0, 24)


CHECKS = kernel_checks.collect(globals())


test_interpreted, test_on_gpu = kernel_checks.make_tests(__file__, CHECKS)


if __name__ == "__main__":
    kernel_checks.main(CHECKS)
