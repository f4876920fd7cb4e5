"""Triton kernels (imported lazily by the layers, only on CUDA)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division on host ints; triton.cdiv is a JIT function, slow to call per row."""
    return -(-a // b)
