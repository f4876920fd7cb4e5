"""The CUDA kernels that no CPU test runs natively compile for sm_90 (Hopper) without a GPU:
Triton's own compiler and its bundled ptxas, on signatures like the engine's launches. The
interpreter checks their arithmetic; this catches what only the GPU compiler sees (types of
pointer blocks, dot operand layouts, inline PTX). The compiles run in one child process
without TRITON_INTERPRET (a test process may have imported the kernels interpreted); skipped
where Triton cannot target CUDA."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if __name__ == "__main__":  # the child: make `minisgl` and `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


class _NoTarget(Exception):
    """Triton cannot compile for sm_90 in this install (no CUDA backend or ptxas)."""


def _compile(fn: object, sig: dict[str, str], consts: dict[str, object], warps: int,
             stages: int) -> None:  # fmt: skip
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    full = {**sig, **dict.fromkeys(consts, "constexpr")}
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(full.values()) if t[0] == "*"}
    src = ASTSource(fn, full, constexprs=consts, attrs=attrs)
    options = {"num_warps": warps, "num_stages": stages}
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except (RuntimeError, FileNotFoundError) as e:
        if "ptxas" in str(e) or "backend" in str(e).lower():
            raise _NoTarget(str(e)) from None
        raise
    cubin = kernel.asm["cubin"]
    assert isinstance(cubin, bytes) and len(cubin) > 0


_I32 = "i32"


def gemv_prologue(silu: bool, norm: int, flat: bool = False) -> None:
    from minisgl.kernels.gemv import _gemv_kernel

    sig = dict.fromkeys(("x_ptr", "w_ptr", "b_ptr", "out_ptr", "res_ptr", "nw_ptr"), "*bf16")
    sig["res_out_ptr"] = "*bf16"
    ints = ("rows", "n_cols", "k_dim", "stride_xm", "stride_wn", "stride_om", "stride_rm")
    sig |= dict.fromkeys(ints, _I32)
    sig["eps"] = "fp32"
    consts = dict(HAS_BIAS=False, SILU_X=silu, NORM=norm, BLOCK_M=1, BLOCK_N=8, BLOCK_K=512,
                  FLAT=flat, PDL=True, NORM_K=2048 if norm else 0)  # fmt: skip
    _compile(_gemv_kernel, sig, consts, 4, 4)


def fp8_moe_gemm(block_m: int, scalar_bs: bool) -> None:
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
                  SK=128, SCALAR_BS=scalar_bs, PDL=True)  # fmt: skip
    _compile(_moe_gemm_kernel, sig, consts, 4, 3)


def moe_align(experts: int) -> None:
    """The MoE alignment's two kernels at the chunk size moe_align_block_size picks."""
    from minisgl.kernels.moe_align import _align_count_kernel, _align_place_kernel, align_chunk

    chunk = align_chunk(experts)
    sig = {"ids_ptr": "*i32", "chunk_counts_ptr": "*i32", "sorted_ptr": "*i32",
           "num_pairs": _I32, "max_padded": _I32}  # fmt: skip
    _compile(_align_count_kernel, sig, dict(E_POW2=experts, CHUNK=chunk, PDL=True), 4, 1)
    sig = {"ids_ptr": "*i32", "chunk_counts_ptr": "*i32", "counts_through_ptr": "*i32",
           "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32",
           "num_pairs": _I32, "num_blocks": _I32}  # fmt: skip
    consts = dict(NUM_EXPERTS=experts, E_POW2=experts, BLOCK_M=16, CHUNK=chunk, PDL=True)
    _compile(_align_place_kernel, sig, consts, 4, 1)


def fp8_gemm(ws_mode: int) -> None:
    from minisgl.extensions.quantization.kernels.fp8_gemm import _fp8_gemm_kernel

    sig = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
           "b_ptr": "*bf16", "out_ptr": "*bf16"}  # fmt: skip
    sig |= dict.fromkeys(("rows", "n_cols", "k_dim", "stride_om", "stride_ws"), _I32)
    sn, sk = (1, 4096) if ws_mode == 2 else (128, 128)
    consts = dict(SN=sn, SK=sk, WS_MODE=ws_mode, HAS_BIAS=False, BLOCK_M=128, BLOCK_N=128,
                  BLOCK_K=128, GROUP_M=8, PDL=True)  # fmt: skip
    _compile(_fp8_gemm_kernel, sig, consts, 8, 3)


def fp8_silu_inputs() -> None:
    """The FP8 down projection's kernels reading a gated MLP's [gate | up]: the activation
    quantizer and the one-row FLAT GEMV."""
    from minisgl.extensions.quantization.kernels.fp8_gemm import _quant_kernel

    sig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
    sig |= dict.fromkeys(("rows", "groups", "stride_xm", "stride_sm", "stride_sg"), _I32)
    _compile(_quant_kernel, sig, dict(GROUP=128, BLOCK_G=8, SILU=True, PDL=True), 4, 1)
    fp8_gemv_prologue(silu=True, norm=0)


def fp8_gemv_prologue(silu: bool, norm: int) -> None:
    """The one-row FLAT FP8 GEMV with a prologue: SiLU-and-mul or (add +) RMSNorm."""
    from minisgl.extensions.quantization.kernels.fp8_gemv import _fp8_gemv_kernel

    sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*fp32",
           "out_ptr": "*bf16", "res_ptr": "*bf16", "nw_ptr": "*bf16", "res_out_ptr": "*bf16"}  # fmt: skip
    ints = ("rows", "n_cols", "k_dim", "stride_xm", "stride_om", "stride_s", "stride_rm")
    sig |= dict.fromkeys(ints, _I32)
    sig["eps"] = "fp32"
    consts = dict(SN=128, SK=128, ROW_SCALE=False, HAS_BIAS=False, BLOCK_M=1, BLOCK_N=8,
                  BLOCK_K=2048, PREFETCH=False, R=16, FLAT=True, SILU=silu, PDL=True, NORM=norm,
                  NORM_K=2048 if norm else 0)  # fmt: skip
    _compile(_fp8_gemv_kernel, sig, consts, 8, 1)


def norm_quant(block_m: int, block_n: int) -> None:
    """The RMSNorm writing e4m3 activations and their scales (kernels/norm.py's QUANT)."""
    from minisgl.kernels.norm import _rms_norm_kernel

    sig = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp8e4nv",
           "res_out_ptr": "*bf16"}  # fmt: skip
    ints = ("n_rows", "n_cols", "heads", "stride_xt", "stride_xh", "stride_rt", "stride_rh")
    sig |= dict.fromkeys(ints, _I32)
    sig |= {"eps": "fp32", "s_ptr": "*fp32", "stride_sm": _I32, "stride_sg": _I32}
    consts = dict(HAS_RES=True, BLOCK_M=block_m, BLOCK_N=block_n, QUANT=True, PDL=True)
    _compile(_rms_norm_kernel, sig, consts, 4, 3)


def decode_fold(kv: str, mode: int, direct: bool) -> None:
    """The decode kernel with q/k norm, RoPE and the K/V store folded in (decode_fold.py:
    inline mul.rn, the barrier, an fp8 cache stored as bytes in modes 1-3)."""
    from minisgl.kernels.decode_attention import _decode_split_kernel

    cache = "*bf16" if kv == "bf16" else ("*fp8e4nv" if mode == 0 else "*u8")
    sig = {"q_ptr": "*bf16", "k_cache_ptr": cache, "v_cache_ptr": cache,
           "page_table_ptr": "*i32", "row_ids_ptr": "*i32", "seq_lens_ptr": "*i32",
           "num_splits_ptr": "*i32", "q_index_ptr": "*i32",
           "mid_o_ptr": "*bf16" if direct else "*fp32", "mid_lse_ptr": "*fp32",
           "qk_scale": "fp32", "v_mul": "fp32"}  # fmt: skip
    strides = ("stride_qt", "stride_qh", "stride_cs", "stride_ch", "stride_pt", "stride_mo_b",
               "stride_mo_h", "stride_mo_s", "stride_ml_b", "stride_ml_h")  # fmt: skip
    sig |= dict.fromkeys(strides, _I32)
    sig |= {"k_ptr": "*bf16", "v_ptr": "*bf16", "pos_ptr": "*i64", "slots_ptr": "*i64",
            "cos_ptr": "*fp32", "sin_ptr": "*fp32", "qw_ptr": "*bf16", "kw_ptr": "*bf16",
            "eps": "fp32", "n_cols": _I32}  # fmt: skip
    sig |= dict.fromkeys(("stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_cos",
                          "stride_sin"), _I32)  # fmt: skip
    block_n = 128 if direct else 64  # the engine's tiles (triton_plan.decode_tiles)
    consts = dict(GROUP=2, HEAD_DIM=128, BLOCK_H=16, BLOCK_D=128, BLOCK_N=block_n,
                  DOT_PREC="tf32", UPCAST=False, GATHER=False, DIRECT=direct, KV_F16=mode,
                  E5M2=False, V_SCALED=mode in (2, 3), ASM=True, FOLD=True, HAS_NORM=True,
                  PDL=True)  # fmt: skip
    _compile(_decode_split_kernel, sig, consts, 4, 1)


CASES = {
    "decode_fold_split": functools.partial(decode_fold, "bf16", 0, False),
    "decode_fold_fp8_bytes_direct": functools.partial(decode_fold, "e4m3", 1, True),
    "norm_quant_8b": functools.partial(norm_quant, 1, 4096),
    "norm_quant_0_6b": functools.partial(norm_quant, 2, 1024),
    "fp8_silu_inputs": fp8_silu_inputs,
    "fp8_gemv_add_norm": functools.partial(fp8_gemv_prologue, False, 2),
    "gemv_silu": functools.partial(gemv_prologue, True, 0),
    "gemv_norm": functools.partial(gemv_prologue, False, 1),
    "gemv_add_norm": functools.partial(gemv_prologue, False, 2),
    "gemv_add_norm_flat": functools.partial(gemv_prologue, False, 2, True),
    "fp8_moe_m16": functools.partial(fp8_moe_gemm, 16, True),
    "fp8_moe_m64": functools.partial(fp8_moe_gemm, 64, True),
    "fp8_moe_m64_vector_scales": functools.partial(fp8_moe_gemm, 64, False),
    "moe_align_8": functools.partial(moe_align, 8),
    "moe_align_128": functools.partial(moe_align, 128),
    "fp8_gemm_outer_scales": functools.partial(fp8_gemm, 0),
    "fp8_gemm_block_scales": functools.partial(fp8_gemm, 1),
    "fp8_gemm_row_scales": functools.partial(fp8_gemm, 2),
}


@functools.cache
def _child_results() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return dict(json.loads(lines[-1]))


@pytest.mark.parametrize("name", list(CASES))
def test_compiles_for_sm90(name: str) -> None:
    pytest.importorskip("triton")
    result = _child_results()[name]
    if result.startswith("no target"):
        pytest.skip(result)
    assert result == "compiled", result


if __name__ == "__main__":
    import traceback

    out = {}
    for case, fn in CASES.items():
        try:
            fn()
            out[case] = "compiled"
        except _NoTarget as e:
            out[case] = f"no target: {e}"
        except Exception:
            out[case] = "failed: " + traceback.format_exc()[-2000:]
    print(json.dumps(out))
