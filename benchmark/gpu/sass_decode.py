"""The decode kernel's sm_90 machine code without a GPU: compile a launch configuration with
the installed Triton (its bundled ptxas and cuobjdump) and count instructions by opcode.

    python benchmark/gpu/sass_decode.py KV MODE BLOCK_N WARPS STAGES [--split] [--fold]

KV is bf16 or e4m3, MODE the fp8 conversion mode (kernels/fp8_kv.py); ``--fold``: q/k norm,
RoPE and the K/V store folded in (kernels/decode_fold.py, with q/k norm). Qwen3-0.6B heads
(group 2, head_dim 128), PDL on, pointers and strides 16-divisible as the engine's launches
specialise them. Prints registers / stack / shared memory, the memory instructions by width,
and the 16 most frequent opcodes (static counts, the prologue included).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

_FOLD_STRIDES = ("stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_cos", "stride_sin")
_STRIDES = ("stride_qt", "stride_qh", "stride_cs", "stride_ch", "stride_pt", "stride_mo_b",
            "stride_mo_h", "stride_mo_s", "stride_ml_b", "stride_ml_h")  # fmt: skip
_DIV16 = {"stride_qt", "stride_qh", "stride_cs", "stride_ch", "stride_pt", "stride_mo_b",
          "stride_mo_h", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_cos",
          "stride_sin"}  # fmt: skip


def compile_decode(
    kv: str, mode: int, tiles: tuple[int, int, int], direct: bool, fold: bool = False
) -> Any:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from minisgl.kernels.decode_attention import _decode_split_kernel

    cache = "*bf16" if kv == "bf16" else ("*fp8e4nv" if mode == 0 else "*u8")
    sig: dict[str, str] = {
        "q_ptr": "*bf16", "k_cache_ptr": cache, "v_cache_ptr": cache, "page_table_ptr": "*i32",
        "row_ids_ptr": "*i32", "seq_lens_ptr": "*i32", "num_splits_ptr": "*i32",
        "q_index_ptr": "*i32", "mid_o_ptr": "*bf16" if direct else "*fp32",
        "mid_lse_ptr": "*fp32", "qk_scale": "fp32", "v_mul": "fp32",
    }  # fmt: skip
    sig.update(dict.fromkeys(_STRIDES, "i32"))
    sig.update({"k_ptr": "*bf16", "v_ptr": "*bf16", "pos_ptr": "*i64", "slots_ptr": "*i64",
                "cos_ptr": "*fp32", "sin_ptr": "*fp32", "qw_ptr": "*bf16", "kw_ptr": "*bf16",
                "eps": "fp32", "n_cols": "i32"})  # fmt: skip
    sig.update(dict.fromkeys(_FOLD_STRIDES, "i32"))
    block_n, warps, stages = tiles
    consts = dict(GROUP=2, HEAD_DIM=128, BLOCK_H=16, BLOCK_D=128, BLOCK_N=block_n,
                  DOT_PREC="tf32", UPCAST=False, GATHER=False, DIRECT=direct, KV_F16=mode,
                  E5M2=False, V_SCALED=mode in (2, 3), ASM=True, FOLD=fold, HAS_NORM=fold,
                  PDL=True)  # fmt: skip
    sig.update(dict.fromkeys(consts, "constexpr"))
    names = list(sig)
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if sig[n].startswith("*") or n in _DIV16
    }
    src = ASTSource(_decode_split_kernel, sig, constexprs=consts, attrs=attrs)
    options = {"num_warps": warps, "num_stages": stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def report(kernel: Any) -> None:
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        Path(cubin).write_bytes(kernel.asm["cubin"])
        res = subprocess.run([tools / "cuobjdump", "-res-usage", cubin], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
        sass = subprocess.run([tools / "cuobjdump", "-sass", cubin], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
    usage = re.findall(r"REG:\d+ STACK:\d+", res)
    print(f"{usage} shared {kernel.metadata.shared} B")
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass, re.M)
    mem = Counter(o for o in ops if re.match(r"(LDG|LDS|LDSM|STS|STSM|LDGSTS|F2F|F2FP)\b", o))
    print("memory / conversions:", ", ".join(f"{n} {o}" for o, n in sorted(mem.items())))
    top = Counter(o.split(".")[0] for o in ops).most_common(16)
    print(f"{len(ops)} instructions:", ", ".join(f"{o} {n}" for o, n in top))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("kv", choices=("bf16", "e4m3"))
    ap.add_argument("mode", type=int, choices=(0, 1, 2, 3))
    ap.add_argument("tiles", type=int, nargs=3, metavar=("BLOCK_N", "WARPS", "STAGES"))
    ap.add_argument("--split", action="store_true", help="the split kernel (not DIRECT)")
    ap.add_argument("--fold", action="store_true", help="q/k norm, RoPE, K/V store folded in")
    args = ap.parse_args()
    if args.kv == "bf16" and args.mode:
        ap.error("a bf16 cache has mode 0 only")
    report(compile_decode(args.kv, args.mode, tuple(args.tiles), not args.split, args.fold))


if __name__ == "__main__":
    main()
