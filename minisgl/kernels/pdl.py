"""Programmatic dependent launch (PDL, Hopper and newer): each of our kernels may be launched
while the kernel before it on the stream is still running, so its launch latency and start-up
overlap the previous kernel's tail instead of following it. A batch-1 decode step of
Qwen3-8B is ~340 small kernels, and the gaps between them add up.

Safety: a kernel launched this way must not touch global memory that an earlier kernel
writes or reads before ``griddepcontrol.wait`` returns (that wait blocks until the previous
grid has finished and its writes are visible). Every kernel here therefore stores nothing
before `pdl_wait` (fresh outputs from PyTorch's caching allocator may be memory that the
previous kernel is still reading), and loads before it only what no kernel of the step
writes: weights, and the step's metadata that the host fills before the step (positions,
slots, lengths, split counts, the page table). Those loads, and the chains of loads that
depend on them, then overlap the previous kernel's tail (gemv.py, attention.py's decode,
qk_rope_store.py). Kernels without the launch attribute (cuBLAS, PyTorch's own) keep full
stream order. Only the launch and those reads overlap, never the arithmetic, so results are
bit-identical with PDL on or off. MINISGL_PDL=0 turns it off.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from minisgl.env import PDL, TRITON_INTERPRET


@functools.cache
def pdl_enabled() -> bool:
    """True on CUDA devices of compute capability 9.0+, unless MINISGL_PDL=0 or under
    Triton's interpreter (which has no grid-dependency control)."""
    if not PDL.get() or TRITON_INTERPRET.get() not in (None, "0"):
        return False
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def pdl_args() -> dict[str, bool]:
    """Keyword arguments for a launch of a kernel that starts with `pdl_wait(PDL)`."""
    on = pdl_enabled()
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    # Wait for the previous grid (and its memory), then let the next grid launch: its
    # programs will wait here in turn, so at most one grid waits ahead of the running one.
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
