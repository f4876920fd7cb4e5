"""GGUF's quantized blocks split into codes and affine scales, without rounding anything.

Every supported type dequantizes as W = scale * code + offset per 16 inputs, with int8
codes and float32 scale and offset (exact: each is a float16 of the file, or a float16
times a small integer). `split_blocks` returns those three for a [N, K] tensor, computed
as gguf-py's dequantizers compute them, so ``scale * code + offset`` in float32 equals
``gguf.quants.dequantize`` bit for bit (tests/unit/extensions/quantization/test_gguf_cpu.py).
Block layouts: ggml-common.h in llama.cpp (gguf-py mirrors them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import Q4_K

QK_K = 256  # inputs per K-quant super-block
# Inputs per block, bytes per block.
BLOCKS: dict[T, tuple[int, int]] = {
    T.Q4_0: (32, 18),
    T.Q4_1: (32, 20),
    T.Q8_0: (32, 34),
    T.Q4_K: (QK_K, 144),
    T.Q6_K: (QK_K, 210),
}
SUPPORTED = frozenset(BLOCKS)
FOUR_BIT = frozenset({T.Q4_0, T.Q4_1, T.Q4_K})  # the rest: signed 8-bit codes


@dataclass
class SplitBlocks:
    """W [N, K] = scale * code + offset, per 16 inputs (a 32-input group repeats its pair)."""

    codes: np.ndarray  # int8 [N, K]
    scale: np.ndarray  # float32 [N, K / 16]
    offset: np.ndarray  # float32 [N, K / 16]


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, n: int) -> np.ndarray:
    """Bytes [..., n] -> 2n values: the low nibbles, then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(*qs.shape[:-1], 2 * n)


def _zeros(rows: int, cols: int) -> np.ndarray:
    return np.zeros((rows, cols // 16), dtype=np.float32)


def _per16(values: np.ndarray, rows: int) -> np.ndarray:
    """One value per 32 inputs [rows, K / 32] -> per 16 [rows, K / 16]."""
    return np.repeat(values.reshape(rows, -1), 2, axis=1)


def split_blocks(raw: np.ndarray, qtype: T, shape: tuple[int, int]) -> SplitBlocks:
    """``raw``: the tensor's bytes as stored (rows of blocks); ``shape``: [N, K]."""
    rows, cols = shape
    size, nbytes = BLOCKS[qtype]
    if cols % size:
        raise ValueError(f"{qtype.name} rows of {cols} inputs are not whole {size}-input blocks")
    b = np.asarray(raw, dtype=np.uint8).reshape(-1, nbytes)
    if qtype == T.Q8_0:
        d = _f16(b[:, :2])
        codes = b[:, 2:].view(np.int8)
        return SplitBlocks(codes.reshape(rows, cols), _per16(d, rows), _zeros(rows, cols))
    if qtype in (T.Q4_0, T.Q4_1):
        d = _f16(b[:, :2])
        q = _nibbles(b[:, 2 + 2 * (qtype == T.Q4_1) :], 16).astype(np.int8)
        if qtype == T.Q4_0:
            return SplitBlocks((q - 8).reshape(rows, cols), _per16(d, rows), _zeros(rows, cols))
        return SplitBlocks(q.reshape(rows, cols), _per16(d, rows), _per16(_f16(b[:, 2:4]), rows))
    if qtype == T.Q4_K:
        return _split_q4_k(b, rows, cols)
    return _split_q6_k(b, rows, cols)


def _split_q4_k(b: np.ndarray, rows: int, cols: int) -> SplitBlocks:
    # d, dmin (fp16), 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, 128 bytes of
    # nibbles: each 32 bytes hold sub-block 2j (low nibbles) and 2j + 1 (high).
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, m = Q4_K.get_scale_min(b[:, 4:16])
    scale = d * sc.astype(np.float32)  # [blocks, 8]
    offset = -(dmin * m.astype(np.float32))
    q = _nibbles(b[:, 16:].reshape(-1, 4, 32), 32).astype(np.int8)
    return SplitBlocks(q.reshape(rows, cols), _per16(scale, rows), _per16(offset, rows))


def _split_q6_k(b: np.ndarray, rows: int, cols: int) -> SplitBlocks:
    # 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16), d fp16.
    ql, qh = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
    scales = b[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    low = _nibbles(ql, 64).reshape(-1, 2, 4, 32)  # [blocks, half, quarter, 32]
    high = (qh[:, :, None, :] >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 0x03
    q = (low | (high << 4)).astype(np.int8) - 32
    scale = (d * scales).reshape(rows, -1)
    return SplitBlocks(q.reshape(rows, cols), scale, _zeros(rows, cols))
