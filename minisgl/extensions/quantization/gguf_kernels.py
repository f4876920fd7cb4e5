"""Packed GGUF weights and the calls into the AVX2 kernels of csrc/cpu_kernels.c.

`pack` turns a layer's loaded parts (int8 codes, scale and offset per 16 inputs) into
segments of rows of one kind, each in its kernel's layout: 4-bit codes two to a byte with a
scale and an offset per 32 inputs (Q4_0, Q4_1, Q4_K), or int8 codes with a scale per 32
(Q8_0) or 16 (Q6_K). Scales are float16 where that is exact, else float32. Nothing is
rounded: the segment's weight is the file's (`Segment.dequantized`, used by the tests).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from gguf import GGMLQuantizationType as T

from minisgl.env import CPU_TILE_ROWS
from minisgl.extensions.quantization.gguf_blocks import FOUR_BIT
from minisgl.extensions.quantization.switches import GGUF_KERNELS
from minisgl.kernels import cpu

# From this many rows on, products dequantize tiles of this many weight rows to float32 and
# multiply them with torch's GEMM (a 256-token prefill of the default model: 0.94 s on the
# integer kernels, RESULTS.md).
DEQUANT_MIN_ROWS = 32
DEQUANT_TILE_ROWS = 2048


def kernels_available() -> bool:
    """The C kernels are built, the CPU has AVX2, and MINISGL_GGUF_KERNELS is on."""
    return cpu.built() and GGUF_KERNELS.get()


def tile_rows() -> int:
    """The kernels' float32 tiles serve products of this many rows or more (0: never)."""
    return int(CPU_TILE_ROWS.get())


@dataclass
class Segment:
    """Rows [start, start + rows) of a layer's weight, all of one kind."""

    start: int
    rows: int
    four_bit: bool
    codes: torch.Tensor  # 4-bit: uint8 [rows, K / 2]; 8-bit: int8 [rows, K]
    scale: torch.Tensor  # [rows, K / group], float16 or float32
    offset: torch.Tensor  # 4-bit: like scale; 8-bit: empty
    group: int  # inputs per scale: 32, or 16 for Q6_K
    bound: Callable[..., None] = field(init=False, repr=False)  # the kernel, weight bound
    bound_dequant: Callable[..., None] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # The weight's arguments bound once: a call passes the activations and output only.
        half = int(self.scale.dtype == torch.float16)
        offset = self.offset.data_ptr() if self.four_bit else 0
        weight = (self.codes.data_ptr(), self.scale.data_ptr(), offset, half)
        group = 0 if self.four_bit else self.group
        self.bound = functools.partial(cpu.module().mm, *weight, group)
        self.bound_dequant = functools.partial(cpu.module().dequant, *weight, group)

    def kernel_segment(self) -> tuple[int, int, int, int, int, int, int]:
        """This segment as the C decode stack takes it (layers/quantization.py)."""
        half = int(self.scale.dtype == torch.float16)
        offset = self.offset.data_ptr() if self.four_bit else 0
        group = 0 if self.four_bit else self.group
        weight = (self.codes.data_ptr(), self.scale.data_ptr(), offset, half, group)
        return (*weight, self.start, self.rows)

    def matmul_dequantized(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """`matmul` for many rows: float32 tiles of the weight through torch's GEMM (the
        integer kernels' work grows with the rows; a GEMM's per-row cost is far lower)."""
        k = x.shape[1]
        for n0 in range(0, self.rows, DEQUANT_TILE_ROWS):
            n1 = min(self.rows, n0 + DEQUANT_TILE_ROWS)
            w = torch.empty(n1 - n0, k)
            self.bound_dequant(n0, n1, k, w.data_ptr())
            out[:, self.start + n0 : self.start + n1] = x @ w.T

    def matmul(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[:, start:start + rows] = x W^T for float32 x [M, K] and out [M, N], both
        contiguous."""
        m, k = x.shape
        dst = out.data_ptr() + self.start * out.element_size()
        self.bound(self.rows, out.shape[1], x.data_ptr(), m, k, dst, tile_rows())

    def rows_dequantized(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 rows ``rows`` (indices into the segment) of the weight."""
        if self.four_bit:
            packed = self.codes[rows]
            lo, hi = packed & 0x0F, packed >> 4
            k = packed.shape[1] * 2
            codes = torch.cat([lo.view(-1, k // 32, 16), hi.view(-1, k // 32, 16)], dim=2)
            offset: torch.Tensor | float = self.offset[rows].float()[..., None]
        else:
            k = self.codes.shape[1]
            codes = self.codes[rows].view(-1, k // self.group, self.group)
            offset = 0.0
        w = codes.float() * self.scale[rows].float()[..., None] + offset
        return w.view(-1, k)

    def dequantized(self) -> torch.Tensor:
        return self.rows_dequantized(torch.arange(self.rows))


def _exact_half(*tensors: torch.Tensor) -> bool:
    return all(bool((t.half().float() == t).all()) for t in tensors)


Part = tuple[int, T, torch.Tensor, torch.Tensor, torch.Tensor]  # start, type, codes, scale, offset


def _segment(
    start: int, qtype: T, codes: torch.Tensor, scale: torch.Tensor, off: torch.Tensor
) -> Segment:
    rows, k = codes.shape
    if qtype in FOUR_BIT:
        scale, off = scale[:, ::2].contiguous(), off[:, ::2].contiguous()
        if qtype == T.Q4_0:  # signed codes q - 8 -> unsigned q, offset -8 * scale
            codes, off = codes + 8, off - 8 * scale
        u = codes.to(torch.uint8).view(rows, k // 32, 2, 16)
        packed = (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(rows, k // 2)
        dtype = torch.float16 if _exact_half(scale, off) else torch.float32
        return Segment(start, rows, True, packed, scale.to(dtype), off.to(dtype), 32)
    group = 32 if qtype == T.Q8_0 else 16
    if group == 32:
        scale = scale[:, ::2].contiguous()
    dtype = torch.float16 if _exact_half(scale) else torch.float32
    return Segment(
        start, rows, False, codes.contiguous(), scale.to(dtype), scale.new_empty(0), group
    )


def pack(parts: list[Part]) -> list[Segment]:
    """Segments of ``parts`` (sorted by start), merging neighbours of the same layout."""
    segments: list[Segment] = []
    for part in parts:
        seg = _segment(*part)
        prev = segments[-1] if segments else None
        if (
            prev is not None
            and prev.start + prev.rows == seg.start
            and (prev.four_bit, prev.group, prev.scale.dtype)
            == (seg.four_bit, seg.group, seg.scale.dtype)
        ):
            segments[-1] = Segment(
                prev.start,
                prev.rows + seg.rows,
                seg.four_bit,
                torch.cat([prev.codes, seg.codes]),
                torch.cat([prev.scale, seg.scale]),
                torch.cat([prev.offset, seg.offset]),
                seg.group,
            )
        else:
            segments.append(seg)
    return segments
