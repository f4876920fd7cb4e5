"""Linear products, picked per device and number of rows, because the defaults are slow for few.

CUDA, 16-bit, one row (batch-1 decode): a Triton GEMV (kernels/gemv.py) where it beats cuBLAS
on the H200; pack_model picks its tiles per layer at load time (MINISGL_TRITON_GEMV=0: off).

Measured on the 2-core AMD EPYC dev box (fp32, SmolLM2-135M's 30 layers, best of 12):
``F.linear`` (MKL) takes 57 ms per batch-1 decode forward and 76 ms for the 5 tokens of a
speculative verify — its GEMV reads the weights at ~11 GB/s and its small-M GEMM is slower
still. The same product as W @ x^T (the large operand first, both K-contiguous) streams them
at ~30 GB/s for 2 rows (29 ms per decode); from 3 rows on, oneDNN with weights reordered
once at load time does best (36 ms for the 5-token verify), up to 256 rows (MKL beyond).
oneDNN caches a primitive per shape and that cache grew the scheduler's memory by ~10% over
a soak test, so its row counts are padded to 19 bucket sizes.
Results equal F.linear's up to float rounding. Elsewhere (CUDA, other dtypes) F.linear runs.
The reordered weights are a second copy (+~0.5 GB for SmolLM2-135M in fp32);
MINISGL_CPU_ONEDNN=0 keeps only the originals (and F.linear from 3 rows on).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.env import CPU_ONEDNN, TRITON_GEMV
from minisgl.kernels import GemvTiles


def _onednn_available() -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


ONEDNN = _onednn_available() and CPU_ONEDNN.get()


def _no_gemv(*args: object, **kwargs: object) -> torch.Tensor:
    raise RuntimeError("GEMV tiles without the GEMV: pack_model sets both")


# kernels.gemv.gemv, imported by pack_model (CPU installs never import triton).
_gemv: Callable[..., torch.Tensor] = _no_gemv


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
    gemv_tiles: GemvTiles | None = None,
) -> torch.Tensor:
    """F.linear; ``packed`` is ``weight`` reordered by `pack` (None: not packed);
    ``gemv_tiles``: one-row products run the Triton GEMV with these tiles (see pack_model)."""
    rows = x.shape[0] if x.dim() == 2 else 0
    if gemv_tiles is not None and rows == 1:
        return _gemv(x, weight, bias, gemv_tiles)
    if x.device.type != "cpu" or x.dtype != torch.float32 or rows == 0:
        return F.linear(x, weight, bias)
    if rows <= 2:
        # One row is padded to two: a one-column W @ x^T falls back to the slow GEMV.
        xs = torch.cat([x, x]) if rows == 1 else x
        y = torch.mm(weight, xs.T).T[:rows].contiguous()
        return y + bias if bias is not None else y
    if packed is not None and rows <= ONEDNN_MAX_ROWS:
        # oneDNN keeps a primitive (and its scratch memory) per distinct shape: padding the
        # rows to a few bucket sizes keeps that cache, and the process's memory, bounded.
        b = onednn_rows(rows)
        xp = x if b == rows else torch.cat([x, x.new_zeros(b - rows, x.shape[1])])
        y = torch.ops.mkldnn._linear_pointwise(xp, packed, bias, "none", [], "")
        return y if b == rows else y[:rows]
    return F.linear(x, weight, bias)


def gemv_silu_mul(
    gate_up: torch.Tensor, weight: torch.Tensor, gemv_tiles: GemvTiles
) -> torch.Tensor:
    """One row of silu(gate) * up (``gate_up`` [1, 2K]) times weight [N, K]^T, in the GEMV
    (kernels/gemv.py's silu_x): the same bits as silu_and_mul followed by the GEMV."""
    return _gemv(gate_up, weight, None, gemv_tiles, silu_x=True)


def gemv_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gemv_tiles: GemvTiles,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) W^T (+ bias), x + residual) for one row in the GEMV
    (kernels/gemv.py's gemv_add_rms_norm; CUDA only, where pack_model set the tiles)."""
    from minisgl.kernels.gemv import gemv_add_rms_norm as kernel

    return kernel(x, residual, norm_weight, eps, weight, bias, gemv_tiles)


# Beyond this many rows MKL's GEMM is efficient and oneDNN gains little.
ONEDNN_MAX_ROWS = 256


def onednn_rows(rows: int) -> int:
    """The bucket a product of ``rows`` rows is padded to: exact up to 16 (speculative
    verifies, small batches), then 32, 64 and multiples of 64: 19 sizes in all."""
    if rows <= 16:
        return rows
    if rows <= 64:
        return 1 << (rows - 1).bit_length()
    return -(-rows // 64) * 64


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN reordering of a CPU fp32 weight (an extra copy), or None where unused."""
    if not ONEDNN or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def pack_model(model: nn.Module, gemv: bool | None = None) -> None:
    """Prepare every layer that computes through `linear` (after loading): CPU weights
    reordered for oneDNN; CUDA 16-bit weights given GEMV tiles where the GEMV wins
    (``gemv``: the TRITON_GEMV switch unless given)."""
    global _gemv
    gemv = TRITON_GEMV.get() if gemv is None else gemv
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(type(module), "cpu_packed") and isinstance(weight, torch.Tensor):
            setattr(module, "cpu_packed", pack(weight))  # noqa: B010 (not a registered buffer)
            tiles = None
            if gemv and weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16):
                from minisgl.kernels import gemv as gemv_kernels

                _gemv = gemv_kernels.gemv
                tiles = gemv_kernels.gemv_choice(1, weight.shape[0], weight.shape[1])
            setattr(module, "gemv_tiles", tiles)  # noqa: B010
