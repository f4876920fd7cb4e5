"""The FP8 Triton kernels (extensions/quantization/kernels/fp8_gemv.py, fp8_gemm.py) against a
float64 product of the same activations (the GEMM: as the kernel quantized them) and the
dequantized weights: block scales (aligned and one per row), per-row scales, bias, odd N and
rows. Run under Triton's interpreter on CPU (one child process, see tests/kernel_checks.py)
and natively on CUDA under the ``gpu`` marker; tests/gpu/test_fp8_gpu.py adds Qwen3-8B's
shapes on CUDA.

Tolerances follow the accumulation: the GEMV sums float32 products, so its error is the
output's rounding (x's dtype) plus K float32 roundings of the running sums; the GEMM's e4m3
dot keeps fewer bits on Hopper tensor cores (DeepSeek-V3 reports ~14), so its term is
2^-10 of the sum of |products| (each 128-input dot is scaled into a float32 accumulator).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from minisgl import env

if __name__ == "__main__":  # the interpreter child: make `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from tests import kernel_checks

E4M3 = torch.float8_e4m3fn


def fp8_weights(
    n: int, k: int, sn: int, sk: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 [N, K], float32 scales [N/sn, K/sk], the dequantized float64 W)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(E4M3)
    s = torch.rand(n // sn, k // sk, generator=g) * 1e-3 + 1e-4
    w = q.double() * s.double().repeat_interleave(sn, 0).repeat_interleave(sk, 1)
    return q, s, w


def _close(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, eps: float) -> None:
    err = (got.double() - ref).abs()
    tol = eps * ref.abs() + bound + 1e-6
    assert bool((err <= tol).all()), (err - tol).max().item()


def gemv_case(rows: int, n: int, k: int, sn: int, sk: int, dtype: torch.dtype, bias: bool,
              device: torch.device, tiles: tuple[int, ...] | None = None) -> None:  # fmt: skip
    from minisgl.extensions.quantization.kernels.fp8_gemv import fp8_gemv

    q, s, w = fp8_weights(n, k, sn, sk, rows + n + k + sn)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(rows, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    got = fp8_gemv(
        x.to(device),
        q.to(device),
        s.to(device),
        None if b is None else b.to(device),
        tiles,  # type: ignore[arg-type]
    )
    assert got.shape == (rows, n) and got.dtype == dtype
    xd, w = x.double().to(device), w.to(device)  # the reference where the kernel ran (speed)
    ref = xd @ w.T + (0 if b is None else b.double().to(device))
    eps = torch.finfo(dtype).eps
    _close(got, ref, k * 2**-24 * (xd.abs() @ w.abs().T), eps)


def gemm_case(rows: int, n: int, k: int, sn: int, sk: int, dtype: torch.dtype, bias: bool,
              device: torch.device, cublas: bool = False) -> None:  # fmt: skip
    """``cublas``: cuBLASLt's block-scaled GEMM (fp8_gemm.cublas_fp8_gemm) instead."""
    from minisgl.extensions.quantization.kernels.fp8_gemm import (
        cublas_fp8_gemm,
        fp8_gemm,
        quantize_groups,
    )

    q, s, w = fp8_weights(n, k, sn, sk, rows + n + k + sn)
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(rows, k, generator=g) * 3).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    gemm = cublas_fp8_gemm if cublas else fp8_gemm
    got = gemm(x, q.to(device), s.to(device), None if b is None else b.to(device))
    assert got.shape == (rows, n) and got.dtype == dtype
    xq, xs = quantize_groups(x)
    xd, w = xq.double() * xs.double().repeat_interleave(128, 1), w.to(device)
    ref = xd @ w.T + (0 if b is None else b.double().to(device))
    eps = torch.finfo(dtype).eps
    _close(got, ref, 2**-10 * (xd.abs() @ w.abs().T), eps)


def check_fp8_gemv_block_scales(device: torch.device) -> None:
    gemv_case(1, 256, 384, 128, 128, torch.bfloat16, False, device)
    gemv_case(3, 256, 512, 128, 128, torch.bfloat16, True, device)
    gemv_case(2, 48, 256, 1, 128, torch.float32, False, device)  # one row per scale


def check_fp8_gemv_prefetch_and_run_sums(device: torch.device) -> None:
    """The tiles' variants: next step prefetched, sums over runs of R inputs, one row's
    products in the weights' 2-D layout (FLAT; ignored above one row)."""
    gemv_case(1, 256, 640, 128, 128, torch.bfloat16, False, device, (1, 8, 256, 4, 1, 1, 16, 0))
    gemv_case(2, 64, 384, 1, 384, torch.bfloat16, True, device, (2, 16, 128, 4, 1, 0, 16, 1))
    gemv_case(4, 128, 512, 128, 128, torch.float32, False, device, (4, 4, 256, 4, 1, 1, 1, 0))
    gemv_case(1, 256, 640, 128, 128, torch.bfloat16, True, device, (1, 8, 256, 4, 1, 0, 1, 1))
    gemv_case(1, 100, 384, 1, 384, torch.bfloat16, False, device, (1, 4, 128, 4, 1, 1, 16, 1))
    gemv_case(1, 256, 512, 128, 128, torch.float32, False, device, (1, 16, 128, 4, 1, 1, 1, 1))


def check_fp8_gemv_row_scales(device: torch.device) -> None:
    gemv_case(1, 100, 256, 1, 256, torch.bfloat16, True, device)
    gemv_case(4, 37, 128, 1, 128, torch.float16, False, device)


def check_fp8_gemm(device: torch.device) -> None:
    gemm_case(5, 256, 384, 128, 128, torch.bfloat16, False, device)
    gemm_case(70, 200, 256, 1, 256, torch.bfloat16, True, device)  # per-row scales, odd N
    gemm_case(33, 256, 256, 1, 128, torch.float32, False, device)


def check_fp8_quantize_groups(device: torch.device) -> None:
    from minisgl.extensions.quantization.kernels.fp8_gemm import quantize_groups

    x = torch.randn(7, 1152, generator=torch.Generator().manual_seed(1)).bfloat16()
    q, s = (t.cpu() for t in quantize_groups(x.to(device)))
    groups = x.float().view(7, 9, 128)
    want = groups.abs().amax(-1) / 448
    # CUDA's fast division may leave a scale 1 ulp off torch's (seen on the H100).
    torch.testing.assert_close(s, want, rtol=2.5e-7, atol=0)
    if device.type == "cuda":  # the interpreter's float -> e4m3 does not round to nearest
        # Within one e4m3 step (3 mantissa bits) of the values divided by the kernel's scales.
        ref = (groups / s[..., None]).to(E4M3).float().view(7, -1)
        torch.testing.assert_close(q.float(), ref, rtol=0.125, atol=2**-9)


def check_fp8_silu_mul_on_the_way_in(device: torch.device) -> None:
    """The GEMV and the GEMM's quantizer given a gated MLP's [gate | up] (``silu_x``) equal
    them given SiLU-and-mul's own kernel's output, bit for bit."""
    from minisgl.extensions.quantization.kernels.fp8_gemm import fp8_gemm, quantize_groups
    from minisgl.extensions.quantization.kernels.fp8_gemv import fp8_gemv
    from minisgl.kernels.activation import silu_and_mul

    q, s, _ = fp8_weights(96, 384, 1, 128, 5)
    q, s = q.to(device), s.to(device)
    for rows in (1, 3, 9):
        g = torch.Generator().manual_seed(rows)
        gate_up = (torch.randn(rows, 768, generator=g) * 3).bfloat16().to(device)
        h = silu_and_mul(gate_up)
        for column_major in (False, True):  # cuBLASLt's layout: rows padded to 4, 4, 12
            pairs = zip(quantize_groups(gate_up, column_major, silu_x=True), quantize_groups(h))
            for got, want in pairs:
                assert len(got) == (-(-rows // 4) * 4 if column_major else rows)
                got = got[:rows]
                assert torch.equal(got.view(torch.uint8) if got.dtype == E4M3 else got,
                                   want.view(torch.uint8) if want.dtype == E4M3 else want)  # fmt: skip
        assert torch.equal(fp8_gemm(gate_up, q, s, silu_x=True), fp8_gemm(h, q, s))
        if rows <= 4:
            assert torch.equal(fp8_gemv(gate_up, q, s, silu_x=True), fp8_gemv(h, q, s))


def check_fp8_gemv_norm_prologue(device: torch.device) -> None:
    """fp8_gemv_add_rms_norm against kernels/norm.py's add + RMSNorm then fp8_gemv, with and
    without a residual, the sum of squares in one step and in several: the new residual
    bit-equal; the product within a few normalised inputs one bf16 step off (1 / rms summed
    in another order), times their weights, then bf16 rounding."""
    from minisgl.extensions.quantization.kernels.fp8_gemv import fp8_gemv, fp8_gemv_add_rms_norm
    from minisgl.kernels import gemv as gemv_module
    from minisgl.kernels.norm import fused_add_rms_norm, rms_norm

    q, s, w = fp8_weights(256, 384, 128, 128, 11)
    q, s, w = q.to(device), s.to(device), w.to(device)
    g = torch.Generator().manual_seed(12)
    cap = gemv_module.MAX_NORM_K
    try:
        for with_res, max_norm_k in ((True, cap), (False, cap), (True, 256)):
            gemv_module.MAX_NORM_K = max_norm_k
            x, r = ((torch.randn(1, 384, generator=g) * 4).bfloat16().to(device) for _ in "xr")
            nw = (torch.rand(384, generator=g) + 0.5).bfloat16().to(device)
            res = r if with_res else None
            h, want_res = fused_add_rms_norm(x, r, nw, 1e-6) if with_res else (
                rms_norm(x, nw, 1e-6), x)  # fmt: skip
            want = fp8_gemv(h, q, s).float()
            got, got_res = fp8_gemv_add_rms_norm(x, res, nw, 1e-6, q, s)
            assert torch.equal(got_res, want_res)
            bound = 4 * ((h.float().abs() * 2**-7)[:, None, :] * w.float().abs()).amax(-1)
            err = (got.float() - want).abs()
            assert bool((err <= bound + want.abs() * 2**-8 + 1e-6).all()), err.max().item()
    finally:
        gemv_module.MAX_NORM_K = cap


def check_fp8_norm_quantizes_its_output(device: torch.device) -> None:
    """kernels/norm.add_rms_norm_quant equals the plain norm followed by the activation
    quantizer, bit for bit (e4m3 codes, scales, the residual sum), with and without a
    residual, scales in either layout."""
    from minisgl.extensions.quantization.kernels.fp8_gemm import quantize_groups
    from minisgl.kernels.norm import add_rms_norm_quant, fused_add_rms_norm, rms_norm

    g = torch.Generator().manual_seed(3)
    x, r = ((torch.randn(5, 384, generator=g) * 4).bfloat16().to(device) for _ in range(2))
    w = (torch.rand(384, generator=g) + 0.5).bfloat16().to(device)
    for res in (r, None):
        normed, want_res = (
            (rms_norm(x, w, 1e-6), x) if res is None else fused_add_rms_norm(x, res, w, 1e-6)
        )
        want_q, want_s = quantize_groups(normed)
        for column_major in (False, True):
            q, s, got_res = add_rms_norm_quant(x, res, w, 1e-6, column_major)
            # cuBLASLt's layout pads the rows to a multiple of 4 (fp8_gemm.cublas_rows).
            assert len(q) == len(s) == (8 if column_major else 5)
            assert torch.equal(q[:5].view(torch.uint8), want_q.view(torch.uint8))
            assert torch.equal(s[:5], want_s) and (s.stride(0) == 1) == column_major
            assert torch.equal(got_res, want_res)


CHECKS = kernel_checks.collect(globals())


test_interpreted, test_on_gpu = kernel_checks.make_tests(__file__, CHECKS)


if __name__ == "__main__":
    kernel_checks.main(CHECKS)


def test_pack_fp8_layouts() -> None:
    """The kernels' scale grid: 128 x 128 blocks where every block's rows share their scales,
    one row per scale where a shard cut through blocks, [N, 1] per row; None (the caller
    dequantizes) where K or a block's inputs are not whole activation groups."""
    from minisgl.extensions.quantization.fp8_cuda import pack_fp8

    q, s, _ = fp8_weights(256, 256, 128, 128, 0)
    rows = s.repeat_interleave(128, 0)  # fp8.py's load-time form: scales repeated over rows
    packed = pack_fp8(q.float(), rows, (128, 128))
    assert packed is not None and packed[0].dtype == E4M3 and torch.equal(packed[1], s)
    assert torch.equal(packed[0].float(), q.float())
    cut = torch.cat([rows[64:], rows[:64]])  # rows of one 128-row block from two blocks
    packed = pack_fp8(q.float(), cut, (128, 128))
    assert packed is not None and torch.equal(packed[1], cut)
    per_row = torch.rand(256, 1)
    packed = pack_fp8(q.float(), per_row, None)
    assert packed is not None and torch.equal(packed[1], per_row)
    assert pack_fp8(q.float(), rows.repeat_interleave(2, 1), (128, 64)) is None
    assert pack_fp8(q[:, :192].float(), per_row, None) is None


def test_pack_fp8_experts() -> None:
    """Experts [E, N, K] pack per expert: 128 x 128 blocks where every expert's blocks are
    whole, one row per scale where one expert's rows of a block differ."""
    from minisgl.extensions.quantization.fp8_cuda import pack_fp8

    qs, ss = zip(*(fp8_weights(256, 384, 128, 128, e)[:2] for e in range(3)), strict=True)
    q, s = torch.stack(qs), torch.stack(ss)
    rows = s.repeat_interleave(128, 1)
    packed = pack_fp8(q.float(), rows, (128, 128))
    assert packed is not None and packed[0].shape == q.shape and torch.equal(packed[1], s)
    rows[1, 5] += 1.0  # one row of expert 1 off its block's scale
    packed = pack_fp8(q.float(), rows, (128, 128))
    assert packed is not None and torch.equal(packed[1], rows)
    per_row = torch.rand(3, 256, 1)
    packed = pack_fp8(q.float(), per_row, None)
    assert packed is not None and torch.equal(packed[1], per_row)


def test_few_rows_route_by_weight_size() -> None:
    """1-4 rows run the weight-only GEMV, but 2-4 rows of the widest weights the W8A8 GEMM
    on its 64-row tiles (where the H200 sweep measured it faster); more rows the GEMM's own
    tiles, or cuBLASLt's block-scaled GEMM where it runs (the switch on, K/128 a multiple
    of 4; any row count, padded). Shapes only (meta tensors), the kernels replaced by
    recorders."""
    from unittest import mock

    from minisgl.extensions.quantization import FP8_CUBLAS, fp8_cuda
    from minisgl.extensions.quantization.kernels import fp8_gemm, fp8_gemv

    calls: list[tuple[str, object]] = []
    gemv = mock.patch.object(fp8_gemv, "fp8_gemv", lambda *a, **kw: calls.append(("gemv", None)))
    gemm = mock.patch.object(
        fp8_gemm, "fp8_gemm", lambda *a, **kw: calls.append(("gemm", a[4] if len(a) > 4 else None))
    )
    cublas = mock.patch.object(
        fp8_gemm, "cublas_fp8_gemm", lambda *a, **kw: calls.append(("cublas", None))
    )
    # cuBLAS takes K/128 a multiple of 4 (the last: 5), any rows (9: padded to 12).
    shapes = ((6144, 4096, 1), (24576, 4096, 1), (24576, 4096, 4), (6144, 4096, 8),
              (6144, 4096, 9), (256, 640, 12))  # fmt: skip
    for runs in (False, True):
        calls.clear()
        probe = mock.patch.object(fp8_cuda, "cublas_block_gemm_runs", lambda d, r=runs: r)
        with gemv, gemm, cublas, probe:
            for n, k, rows in shapes:
                layer = torch.nn.Module()
                q = torch.empty(n, k, dtype=E4M3, device="meta")
                fp8_cuda.set_fp8_buffers(layer, q, torch.empty(n // 128, k // 128, device="meta"))
                fp8_cuda.fp8_forward(layer, torch.empty(rows, k, device="meta"), None)
        tiles = fp8_cuda.WIDE_FEW_ROWS_TILES
        last = ("cublas", None) if runs else ("gemm", None)
        want = [("gemv", None), ("gemv", None), ("gemm", tiles), last, last, ("gemm", None)]
        assert calls == want, runs
    # The switch turns a device's probed cuBLAS off (an entry as the probe leaves it).
    gpu = torch.device("cuda", 7)
    with mock.patch.dict(fp8_cuda._cublas_runs, {gpu: True}):
        for on in (True, False):
            with env.override({FP8_CUBLAS: on}):
                assert fp8_cuda.cublas_block_gemm_runs(gpu) is on


def test_silu_fusion_routes() -> None:
    """A down projection given [gate | up]: the GEMV's rows fuse the SiLU-and-mul only with
    the engine's SiLU-in-down fusion (``in_gemv``), the GEMM's rows unless MINISGL_FP8_FUSED_ACT
    is off; None (the caller's own SiLU-and-mul kernel) otherwise. Shapes only (meta
    tensors), the kernels replaced by recorders of their ``silu_x``."""
    from unittest import mock

    from minisgl.extensions.quantization import FP8_CUBLAS, FP8_FUSED_ACT, fp8_cuda
    from minisgl.extensions.quantization.kernels import fp8_gemm, fp8_gemv

    calls: list[tuple[str, int, bool]] = []

    def record(name: str):  # type: ignore[no-untyped-def]
        def kernel(x, *a, silu_x=False, **kw):  # type: ignore[no-untyped-def]
            calls.append((name, x.shape[1], silu_x))
            return x

        return kernel

    layer = torch.nn.Module()
    q = torch.empty(4096, 1024, dtype=E4M3, device="meta")
    fp8_cuda.set_fp8_buffers(layer, q, torch.empty(32, 8, device="meta"))
    gemv = mock.patch.object(fp8_gemv, "fp8_gemv", record("gemv"))
    gemm = mock.patch.object(fp8_gemm, "fp8_gemm", record("gemm"))
    with gemv, gemm, env.override({FP8_CUBLAS: False}):
        for fused_act in (True, False):
            with env.override({FP8_FUSED_ACT: fused_act}):
                for rows, in_gemv in ((1, True), (1, False), (64, False)):
                    gate_up = torch.empty(rows, 2048, device="meta")
                    y = fp8_cuda.fp8_silu_forward(layer, gate_up, None, in_gemv)
                    assert (y is None) == (not in_gemv if rows == 1 else not fused_act)
    assert calls == [("gemv", 2048, True), ("gemm", 2048, True), ("gemv", 2048, True)]


def test_norm_fusion_routes() -> None:
    """A q/k/v or gate/up projection given its RMSNorm's input: the GEMM's rows quantize in
    the norm's kernel (scales column-major for cuBLAS) unless MINISGL_FP8_FUSED_ACT is off;
    the GEMV's one row (weight-only) takes the norm in the GEMV's prologue where the engine
    allows it (the norm-in-GEMV fusion), else declines, as do its 2-4 rows. Shapes only (meta
    tensors), the kernels replaced by recorders."""
    from unittest import mock

    from minisgl.extensions.quantization import FP8_CUBLAS, FP8_FUSED_ACT, fp8_cuda
    from minisgl.extensions.quantization.kernels import fp8_gemm, fp8_gemv
    from minisgl.kernels import norm

    calls: list[tuple[str, object]] = []

    def norm_quant(x, res, w, eps, column_major=False):  # type: ignore[no-untyped-def]
        calls.append(("norm", column_major))
        return x, x, x

    def gemm(name: str):  # type: ignore[no-untyped-def]
        def kernel(q, *a, **kw):  # type: ignore[no-untyped-def]
            calls.append((name, q.shape))
            return q

        return kernel

    layer = torch.nn.Module()
    q = torch.empty(1024, 512, dtype=E4M3, device="meta")
    fp8_cuda.set_fp8_buffers(layer, q, torch.empty(8, 4, device="meta"))
    w = torch.empty(512, device="meta")
    patches = (
        mock.patch.object(norm, "add_rms_norm_quant", norm_quant),
        mock.patch.object(fp8_gemm, "quantized_gemm", gemm("gemm")),
        mock.patch.object(fp8_gemm, "cublas_quantized_gemm", gemm("cublas")),
        mock.patch.object(fp8_gemv, "fp8_gemv_add_rms_norm", gemm("gemv")),
    )
    with patches[0], patches[1], patches[2], patches[3]:
        for cublas in (False, True):
            probe = mock.patch.object(fp8_cuda, "cublas_block_gemm_runs", lambda d, c=cublas: c)
            for fused in (True, False):
                with probe, env.override({FP8_FUSED_ACT: fused, FP8_CUBLAS: True}):
                    for rows, in_gemv in ((1, False), (64, True)):
                        x = torch.empty(rows, 512, device="meta")
                        y = fp8_cuda.fp8_norm_forward(layer, x, None, w, 1e-6, None, in_gemv)
                        assert (y is None) == (rows == 1 or not fused)
        x = torch.empty(1, 512, device="meta")
        assert fp8_cuda.fp8_norm_forward(layer, x, None, w, 1e-6, None, True) is not None
        x = torch.empty(2, 512, device="meta")  # the GEMV's rows, but batch 1 only
        assert fp8_cuda.fp8_norm_forward(layer, x, None, w, 1e-6, None, True) is None
    shape = torch.Size([64, 512])
    assert calls == [("norm", False), ("gemm", shape), ("norm", True), ("cublas", shape),
                     ("gemv", torch.Size([1, 512]))]  # fmt: skip
