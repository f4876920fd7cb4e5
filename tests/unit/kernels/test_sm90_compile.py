"""The CUDA kernels that no CPU test runs natively compile for sm_90 (Hopper) without a GPU:
Triton's own compiler and its bundled ptxas, on signatures like the engine's launches. The
interpreter checks their arithmetic; this catches what only the GPU compiler sees (types of
pointer blocks, dot operand layouts, inline PTX). Skipped where Triton cannot target CUDA."""

from __future__ import annotations

import pytest


def _compile(fn: object, sig: dict[str, str], consts: dict[str, object], warps: int,
             stages: int) -> bytes:  # fmt: skip
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    full = {**sig, **dict.fromkeys(consts, "constexpr")}
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(full.values()) if t[0] == "*"}
    src = ASTSource(fn, full, constexprs=consts, attrs=attrs)
    try:
        kernel = triton.compile(
            src,
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": warps, "num_stages": stages},
        )
    except (RuntimeError, FileNotFoundError) as e:  # no ptxas / CUDA backend in this install
        if "ptxas" in str(e) or "backend" in str(e).lower():
            pytest.skip(f"Triton cannot target sm_90 here: {e}")
        raise
    cubin = kernel.asm["cubin"]
    assert isinstance(cubin, bytes) and len(cubin) > 0
    return cubin


_I32 = "i32"


@pytest.mark.parametrize(("silu", "norm"), [(True, 0), (False, 1), (False, 2)])
def test_gemv_prologues_compile(silu: bool, norm: int) -> None:
    from minisgl.kernels.gemv import _gemv_kernel

    sig = dict.fromkeys(("x_ptr", "w_ptr", "b_ptr", "out_ptr", "res_ptr", "nw_ptr"), "*bf16")
    sig["res_out_ptr"] = "*bf16"
    ints = ("rows", "n_cols", "k_dim", "stride_xm", "stride_wn", "stride_om", "stride_rm")
    sig |= dict.fromkeys(ints, _I32)
    sig["eps"] = "fp32"
    consts = dict(HAS_BIAS=False, SILU_X=silu, NORM=norm, BLOCK_M=1, BLOCK_N=8, BLOCK_K=512,
                  PDL=True)  # fmt: skip
    _compile(_gemv_kernel, sig, consts, 4, 4)


@pytest.mark.parametrize(("mode", "block_n"), [(0, 64), (0, 32), (1, 64), (2, 32)])
def test_fp8_gemv_tensor_cores_compiles(mode: int, block_n: int) -> None:
    from minisgl.extensions.quantization.kernels.fp8_gemv_tc import _fp8_gemv_tc_kernel

    sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv" if mode == 0 else "*u8", "s_ptr": "*fp32",
           "b_ptr": "*fp32", "out_ptr": "*bf16"}  # fmt: skip
    sig |= dict.fromkeys(("rows", "n_cols", "k_dim", "stride_xm", "stride_om", "stride_s"), _I32)
    sig["out_mul"] = "fp32"
    consts = dict(SN=128, SK=128, ROW_SCALE=False, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=block_n,
                  BLOCK_K=128, MODE=mode, ASM=True, PDL=True)  # fmt: skip
    _compile(_fp8_gemv_tc_kernel, sig, consts, 4, 3)


@pytest.mark.parametrize("block_m", [16, 64])
def test_fp8_moe_gemm_compiles(block_m: int) -> None:
    from minisgl.kernels.moe import _moe_gemm_kernel

    sig = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "weight_ptr": "*bf16",
           "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32", "sorted_ptr": "*i32",
           "block_expert_ptr": "*i32", "num_padded_ptr": "*i32"}  # fmt: skip
    ints = ("num_pairs", "n_out", "k_dim", "up_offset", "num_pid_m", "stride_am", "stride_ak",
            "stride_be", "stride_bn", "stride_bk", "stride_cm", "stride_cn", "stride_asm",
            "stride_bse", "stride_bsn")  # fmt: skip
    sig |= dict.fromkeys(ints, _I32)
    consts = dict(A_ROW_DIV=8, FUSE_SILU=True, MUL_WEIGHT=False, BLOCK_M=block_m, BLOCK_N=64,
                  BLOCK_K=128, GROUP_M=8, DOT_PREC="tf32", UPCAST=False, FP8=True, SN=128,
                  SK=128, PDL=True)  # fmt: skip
    _compile(_moe_gemm_kernel, sig, consts, 4, 3)
