"""The int4 GEMM Triton kernel (extensions/quantization/kernels/int4_gemm.py) against a
plain torch dequantize-then-matmul: 1-16 rows and prefill-sized ones, several group sizes,
odd N, bias, fp32/bf16/fp16; and the batch-1 int4 GEMV (kernels/int4_gemv.py beside it, 1-4
rows) against the same reference and against the GEMM, in each of its ways of reading
scales and zeros. Run under Triton's interpreter on CPU (one child process, see
tests/kernel_checks.py) and natively on CUDA under the ``gpu`` marker."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # the interpreter child: make `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from tests import kernel_checks


def _weights(
    n: int, k: int, group: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Canonical-layout weights (qweight [K/8, N], scales, zeros [K/G, N]) and the float32
    W [N, K] they stand for, computed element by element from the codes, not the packing."""
    from minisgl.extensions.quantization.int4 import pack_canonical

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
    from minisgl.extensions.quantization.kernels.int4_gemm import int4_gemm

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
    from minisgl.extensions.quantization.kernels.int4_gemm import int4_gemm

    qw, scales, zeros, w = _weights(24, 128, 32, 3)
    big = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
    x = big[:, :128]  # rows strided like a slice of a wider activation
    got = int4_gemm(x.to(device), qw.to(device), scales.to(device), zeros.to(device), 32)
    torch.testing.assert_close(got.cpu(), x @ w.T, atol=1e-4, rtol=1e-4)
    empty = int4_gemm(x[:0].to(device), qw.to(device), scales.to(device), zeros.to(device), 32)
    assert empty.shape == (0, 24)


# ------------------------------------------------------------------ the batch-1 GEMV
def _tolerance(dtype: torch.dtype, ref: torch.Tensor) -> float:
    """fp32: tight (only the summation order differs); 16-bit: 3 ulps of the dtype at the
    output's magnitude (the final rounding plus the accumulation orders of two kernels)."""
    mag = max(float(ref.abs().max()), 1e-3)
    if dtype == torch.float32:
        return 2e-6 * mag
    return 3 * 2.0 ** math.floor(math.log2(mag)) * torch.finfo(dtype).eps


def _gemv_case(
    rows: int, n: int, k: int, group: int, dtype: torch.dtype, bias: bool, dev: torch.device,
    tiles: tuple[int, int, int, int, int] | None = None, stride: int = 0,
) -> None:  # fmt: skip
    """The GEMV against float64 products of the weights rounded to ``dtype`` (as both
    kernels round them), and against the GEMM on the same inputs. ``stride``: x's rows are
    a slice of [rows, k + stride]."""
    from minisgl.extensions.quantization.kernels.int4_gemm import int4_gemm
    from minisgl.extensions.quantization.kernels.int4_gemv import int4_gemv

    qw, scales, zeros, w = _weights(n, k, group, rows * 5 + n + k + group)
    g = torch.Generator().manual_seed(k + rows)
    x = torch.randn(rows, k + stride, generator=g).to(dtype)[:, :k]
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    ref = x.double() @ w.to(dtype).double().T
    if b is not None:
        ref += b.double()
    args = (x.to(dev), qw.to(dev), scales.to(dev), zeros.to(dev), group)
    bd = None if b is None else b.to(dev)
    got = int4_gemv(*args, bd, tiles)
    assert got.shape == (rows, n) and got.dtype == dtype
    tol = _tolerance(dtype, ref)
    torch.testing.assert_close(got.double().cpu(), ref, atol=tol, rtol=0)
    gemm = int4_gemm(*args, bd)
    torch.testing.assert_close(got.double().cpu(), gemm.double().cpu(), atol=tol, rtol=0)


def check_int4_gemv_rows_1_to_4(device: torch.device) -> None:
    for rows in (1, 2, 3, 4):
        _gemv_case(rows, 72, 256, 32, torch.float32, False, device)


def check_int4_gemv_group_sizes(device: torch.device) -> None:
    """Each way of reading scales and zeros (kernels/int4_gemv.py scale_mode) with a 512-input
    K step, odd N and K off the step: group 8, 32 and 128 (a step of whole groups), 1024 (a
    step inside one group), K itself (-1: one group), 24 (per word: neither divides the
    other)."""
    from minisgl.extensions.quantization.kernels import int4_gemv as m

    cases = [(8, 1040, m.PER_GROUP), (32, 544, m.PER_GROUP), (128, 640, m.PER_GROUP),
             (1024, 2048, m.PER_TILE), (200, 200, m.ONE_GROUP), (1032, 1032, m.ONE_GROUP),
             (24, 120, m.PER_WORD)]  # fmt: skip
    for i, (group, k, mode) in enumerate(cases):
        assert m.scale_mode(group, k, 512) == mode, (group, k)
        tiles = (m.int4_gemv_tiles(1 + i % 4)[0], 16, 512, 4, 1)
        _gemv_case(1 + i % 4, 37 + 2 * i, k, group, torch.float32, i % 2 == 0, device, tiles)


def check_int4_gemv_half_precision(device: torch.device) -> None:
    _gemv_case(1, 96, 1536, 128, torch.bfloat16, False, device)
    _gemv_case(4, 33, 640, 128, torch.bfloat16, True, device)
    _gemv_case(2, 50, 1040, 8, torch.bfloat16, False, device)
    _gemv_case(3, 50, 256, 256, torch.float16, True, device)


def check_int4_gemv_explicit_tiles(device: torch.device) -> None:
    """Tiles other than the default: narrow and wide column blocks, short and long K steps
    (down to one word a column), BLOCK_M above the rows."""
    _gemv_case(1, 45, 384, 128, torch.float32, True, device, tiles=(1, 8, 64, 4, 2))
    _gemv_case(3, 45, 2048, 128, torch.float32, False, device, tiles=(4, 32, 1024, 8, 3))
    _gemv_case(2, 19, 96, 32, torch.float32, False, device, tiles=(4, 4, 8, 1, 1))
    _gemv_case(1, 19, 96, 96, torch.bfloat16, False, device, tiles=(1, 16, 32, 4, 2))
    _gemv_case(1, 70, 1536, 128, torch.bfloat16, True, device, tiles=(1, 64, 1024, 8, 1))
    _gemv_case(4, 40, 768, 32, torch.float16, False, device, tiles=(4, 128, 256, 2, 1))
    _gemv_case(2, 21, 1024, 64, torch.bfloat16, False, device, tiles=(2, 32, 512, 4, 1))


def check_int4_gemv_strided_rows_and_empty(device: torch.device) -> None:
    from minisgl.extensions.quantization.kernels.int4_gemv import int4_gemv

    _gemv_case(4, 24, 128, 32, torch.float32, True, device, stride=128)
    _gemv_case(2, 24, 256, 64, torch.bfloat16, False, device, stride=8)
    qw, scales, zeros, _ = _weights(24, 128, 32, 3)
    x = torch.zeros(0, 128, device=device)
    empty = int4_gemv(x, qw.to(device), scales.to(device), zeros.to(device), 32)
    assert empty.shape == (0, 24)


CHECKS = kernel_checks.collect(globals())


test_interpreted, test_on_gpu = kernel_checks.make_tests(
    __file__, CHECKS, slow=("int4_gemv_explicit_tiles", "int4_gemv_half_precision")
)


if __name__ == "__main__":
    kernel_checks.main(CHECKS)
