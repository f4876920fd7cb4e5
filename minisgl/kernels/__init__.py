"""Triton kernels (imported lazily by the layers, only on CUDA)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division on host ints; triton.cdiv is a JIT function, slow to call per row."""
    return -(-a // b)


# GEMV launch tiles: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, FLAT); see kernels/gemv.py.
GemvTiles = tuple[int, int, int, int, int, int]
