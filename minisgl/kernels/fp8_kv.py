"""fp8 KV tiles (``--kv-cache-dtype fp8*``) as float16 operands of the attention dots.

A plain ``.to(bf16)`` of an fp8 tile costs several conversions per element (Triton 3.6's
sm_90 SASS of the decode kernel: 256 ``F2F`` + 144 ``F2FP`` per thread and 128-token tile,
e4m3 -> f16 -> f32 -> bf16), and Triton moves that cast after the shared-memory stage of the
dot operand, where the transposed K tile is read back one byte per ``LDS.U8``: the likely
reasons an fp8 cache decoded slower than bf16 (issue 25).
Here the tiles become float16 on the loaded 16-byte vectors (inline PTX not marked pure,
which Triton does not move), by the hardware ``cvt`` or by moving bits:

* e5m2 is float16's top byte: ``f16 = byte << 8`` is exact.
* e4m3fn's sign, 4 exponent and 3 mantissa bits shifted into float16's fields
  (``(byte & 0x80) << 8 | (byte & 0x7f) << 7``) give the float16 of ``value / 256`` exactly, subnormals
  included (e4m3's bias is 7, float16's 15; e4m3's smallest step 2^-9 / 256 = 2^-17 is a
  float16 subnormal). The 256 is folded into the softmax scale (K) and the output (V).

Default: mode 0 (MINISGL_FP8_KV_MODE). Modes 1-3 are checked under Triton's interpreter and
compiled for sm_90 (their SASS: 16-byte loads, one ``F2FP.F16.E4M3.UNPACK_B`` per pair in
mode 1, no byte-wide shared-memory reads). Timed on an H100 (sweep_decode.py, RESULTS.md
2026-12-06), the upcast was as fast or faster on the offline workload's batches; mode 2
won only on 64 rows of 4,096 tokens, so the upcast stays the default until an H200 sweep
says otherwise.

Modes (``KV_F16`` of the kernels): 0 = the tile upcast to q's dtype (the reference path),
1 = the hardware conversion to float16 (one ``cvt`` per pair, sm_89+), 2 = the bit moves in
PTX on packed registers (two byte permutes and six logic ops per four elements), 3 = the
same bit moves in plain Triton (the interpreter's form of mode 2). Modes 1 and 2 are
inline PTX on the GPU and plain Triton in the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# e4m3 tiles read through the bit moves (modes 2, 3) hold value / 256.
E4M3_BITS_FACTOR = 256.0
UPCAST, CVT, BITS_ASM, BITS = 0, 1, 2, 3

# Four e4m3 bytes of $2 -> four float16 in $0 (bytes 0, 1) and $1 (bytes 2, 3): each byte
# into the high byte of its 16-bit lane (prmt), then the magnitude shifted right by one and
# the sign kept: (lane & 0x8000) | ((lane & 0x7fff) >> 1).
_E4M3_ASM: tl.constexpr = tl.constexpr("""{
.reg .b32 a<2>, b<2>;
prmt.b32 a0, 0, $2, 0x5140;
prmt.b32 a1, 0, $2, 0x7362;
and.b32 b0, a0, 0x7fff7fff;
and.b32 b1, a1, 0x7fff7fff;
shr.b32 b0, b0, 1;
shr.b32 b1, b1, 1;
lop3.b32 $0, a0, 0x80008000, b0, 0xea;
lop3.b32 $1, a1, 0x80008000, b1, 0xea;
}""")
# cvt: one hardware conversion per pair (sm_89+).
_E4M3_CVT: tl.constexpr = tl.constexpr("""{
.reg .b16 lo, hi;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 $0, lo;
cvt.rn.f16x2.e4m3x2 $1, hi;
}""")
_E5M2_CVT: tl.constexpr = tl.constexpr("""{
.reg .b16 lo, hi;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e5m2x2 $0, lo;
cvt.rn.f16x2.e5m2x2 $1, hi;
}""")
_E5M2_ASM: tl.constexpr = tl.constexpr("prmt.b32 $0, 0, $2, 0x5140;\nprmt.b32 $1, 0, $2, 0x7362;")


@triton.jit
def fp8_tile_as_f16(x, E5M2: tl.constexpr, MODE: tl.constexpr, ASM: tl.constexpr):
    """A tile of fp8 bytes (uint8) as float16 (see the module doc for MODE; 2 and 3 give
    e4m3 tiles divided by 256). ``ASM``: not interpreted. The inline PTX is not marked
    pure, so Triton keeps the conversion where it is written, on the tile as loaded (16-byte
    vectors): marked pure, it is moved after the shared-memory stage of the dot operand,
    whose fp8 K tile is then read back one byte per load."""
    if MODE == 1 and ASM:
        if E5M2:
            y = tl.inline_asm_elementwise(
                _E5M2_CVT, "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4
            )
        else:
            y = tl.inline_asm_elementwise(
                _E4M3_CVT, "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4
            )
    elif MODE == 1:
        if E5M2:
            y = x.to(tl.float8e5, bitcast=True).to(tl.float16)
        else:
            y = x.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    elif MODE == 2 and ASM:
        if E5M2:
            y = tl.inline_asm_elementwise(
                _E5M2_ASM, "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4
            )
        else:
            y = tl.inline_asm_elementwise(
                _E4M3_ASM, "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4
            )
    else:
        b = x.to(tl.int32)
        if E5M2:
            bits = b << 8
        else:
            bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
        y = bits.to(tl.int16).to(tl.float16, bitcast=True)
    return y


def kv_f16_mode(cache_dtype: torch.dtype, q_dtype: torch.dtype, mode: int) -> int:
    """The mode a launch uses: fp8 caches under 16-bit queries only (float32 queries keep
    the exact upcast); mode 2 falls back to 3 in Triton's interpreter (no inline PTX)."""
    fp8 = cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if not fp8 or q_dtype not in (torch.bfloat16, torch.float16):
        return UPCAST
    return mode


def bits_factor(cache_dtype: torch.dtype, mode: int) -> float:
    """What the kernel's K and V tiles must be multiplied by (e4m3 through the bit moves)."""
    bits = mode in (BITS_ASM, BITS)
    return E4M3_BITS_FACTOR if bits and cache_dtype == torch.float8_e4m3fn else 1.0


def as_loaded(cache: torch.Tensor, mode: int) -> torch.Tensor:
    """The cache as the kernel loads it: its bytes for modes 1-3."""
    return cache.view(torch.uint8) if mode != UPCAST else cache


@dataclass(frozen=True)
class KVRead:
    """How an attention kernel reads the cache: the per-tensor scales of an fp8 cache (the
    stored value times the scale is the real one; 1.0 unless a checkpoint or calibration
    says otherwise) and the fp8 conversion mode (module doc)."""

    k_scale: float = 1.0
    v_scale: float = 1.0
    mode: int = UPCAST

    def launch(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, q_dtype: torch.dtype, sm_scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, float, float, dict[str, object]]:
        """(k, v as loaded, the base-2 softmax scale, the output's multiplier, the kernel's
        KV_F16 / E5M2 / V_SCALED constants). K's scale and factor fold into the softmax
        scale, V's into the output (attention is linear in V)."""
        mode = kv_f16_mode(k_cache.dtype, q_dtype, self.mode)
        factor = bits_factor(k_cache.dtype, mode)
        qk_scale = sm_scale * LOG2E * self.k_scale * factor
        v_mul = self.v_scale * factor
        consts: dict[str, object] = {"KV_F16": mode, "E5M2": k_cache.dtype == torch.float8_e5m2,
                                     "V_SCALED": v_mul != 1.0, "ASM": not _interpreted()}  # fmt: skip
        return as_loaded(k_cache, mode), as_loaded(v_cache, mode), qk_scale, v_mul, consts


def _interpreted() -> bool:
    return type(fp8_tile_as_f16).__name__ == "InterpretedFunction"
