"""The CPU kernels of csrc/cpu_kernels.c (AVX2, OpenMP), called with tensors' raw pointers.

``pip install`` builds them where a C compiler is found (setup.py); elsewhere, on CPUs
without AVX2, or with MINISGL_CPU_KERNELS=0, the layers keep torch's ops. Every function
takes contiguous float32 CPU tensors (the caller checks `fused_ok`). Threads: torch's own
OpenMP runtime (torch is imported first, and the module links the same libgomp), so
torch.set_num_threads sets ours too.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from minisgl.env import CPU_KERNELS


def _load() -> ModuleType | None:
    try:
        return importlib.import_module("minisgl.kernels._cpu")
    except ImportError:
        return None


_C = _load()


def built() -> bool:
    """The extension is built and this CPU runs it (AVX2)."""
    cpu = torch.backends.cpu.get_cpu_capability()
    return _C is not None and cpu in ("AVX2", "AVX512")


def module() -> ModuleType:
    assert _C is not None, "minisgl.kernels._cpu is not built"
    return _C


BUILT = built()


def fused_ok(x: torch.Tensor) -> bool:
    """The fused kernels serve ``x`` (a float32 CPU tensor, the kernels built and on)."""
    return BUILT and x.device.type == "cpu" and x.dtype == torch.float32 and CPU_KERNELS.get()


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual) of x [T, H]."""
    # Every pointer handed over belongs to a tensor held by a local name: a temporary (as
    # in ``t.contiguous().data_ptr()``) would be freed before the call reads it.
    x = x.contiguous()
    out, total = torch.empty_like(x), torch.empty_like(x)
    res = None if residual is None else residual.contiguous()
    rows, h = x.shape
    module().add_rms_norm(
        x.data_ptr(), 0 if res is None else res.data_ptr(), weight.data_ptr(), eps, rows, h,
        out.data_ptr(), total.data_ptr(),
    )  # fmt: skip
    return out, total


def rope_(
    qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int
) -> None:
    """Rotate the first ``heads`` heads (q's, then k's) of each row of qkv [T, *] in place."""
    d = cos.shape[1]
    pos = positions.to(torch.int64).contiguous()
    module().rope(
        qkv.data_ptr(), qkv.shape[0], qkv.stride(0), 0, heads, d,
        pos.data_ptr(), cos.data_ptr(), sin.data_ptr(),
    )  # fmt: skip


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_index: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    new: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] (one query per request) over caches [slots, Hk, D]; kv_index [B, *]
    int64 slots of each request's positions, seq_lens [B] int64 -> out [B, Hq * D].
    ``new``: this step's (k, v [B, Hk, D], slots [B] int64), stored into the caches first."""
    b, hq, d = q.shape
    q = q.contiguous()
    out = q.new_empty(b, hq * d)
    k, v, slots = (None, None, None) if new is None else (t.contiguous() for t in new)
    module().decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), kv_index.data_ptr(),
        kv_index.stride(0), seq_lens.data_ptr(), scale, b, hq, k_cache.shape[1], d,
        out.data_ptr(), *(0 if t is None else t.data_ptr() for t in (k, v, slots)),
    )  # fmt: skip
    return out
