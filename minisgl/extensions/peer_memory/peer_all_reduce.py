"""All-reduce of small tensors through GPU peer memory (NVLink) instead of NCCL.

A decode step of a TP model all-reduces two hidden-size rows per layer and token (Qwen3-8B:
72 per step, 8 KB each at batch 1). NCCL's latency for such a message is what bounds the
step, not bandwidth. PyTorch's symmetric memory gives every rank a buffer the others can
read: each rank copies its part in, a barrier, each reads every rank's part and sums them
in rank order (the same sum on every rank), and a closing barrier before the buffer is
reused. One kernel, a few microseconds, capturable in CUDA graphs.

The all-reduces that feed a residual add + RMSNorm (every o_proj and down_proj) run fused
with it instead, in one kernel of our own over buffers of the same kind
(kernels/all_reduce_norm.py; MINISGL_FUSED_ALL_REDUCE_NORM=0 turns that off). At batch 1
the o_proj / down_proj GEMV pushes its rows to the peers itself (kernels/pushing_gemv.py),
and the norm kernel only polls (`pushed_gemv`; MINISGL_GEMV_PUSH=0 turns that off).

Bigger tensors (prefill) and dtypes the kernel lacks go to NCCL. Two ranks sum a + b
either way, so the result equals NCCL's exactly. ``--disable-custom-all-reduce`` (or no
peer access between the GPUs) keeps NCCL for everything.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from minisgl.distributed.reducer import all_ranks_agree
from minisgl.extensions.peer_memory.options import FUSED_ALL_REDUCE_NORM, GEMV_PUSH

if TYPE_CHECKING:
    from minisgl.extensions.peer_memory.kernels.all_reduce_norm import LamportPush
    from minisgl.kernels import GemvTiles

logger = logging.getLogger(__name__)

# Largest message it takes: a decode batch of 256 rows of a 4,096-wide model is 2 MiB.
MAX_BYTES = 8 * 2**20
_ALIGN = 16  # the kernel's vector width: pointers and sizes must be multiples of it
# The fused all-reduce + norm: per alternate call and source rank, a slot of 512 rows of a
# 4,096-wide bf16 model; an epoch per program (a program per row, or per few short rows).
NORM_SLOT_BYTES = 4 * 2**20
NORM_MAX_PROGRAMS = 4096
_NORM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _peer_addresses(t: torch.Tensor, handle: object) -> torch.Tensor:
    """int64 [world] on t's device: where every rank's copy of symmetric tensor ``t`` is
    mapped in this process."""
    ptrs = handle.buffer_ptrs  # type: ignore[attr-defined]
    offset = t.data_ptr() - ptrs[handle.rank]  # type: ignore[attr-defined]
    return torch.tensor([p + offset for p in ptrs], dtype=torch.int64, device=t.device)


class PeerAllReduce:
    """One symmetric buffer per dtype, rendezvoused once over the default process group (a
    distributed/reducer.py Reducer)."""

    def __init__(self, device: torch.device, dtypes: tuple[torch.dtype, ...]) -> None:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD
        assert group is not None
        self.group_name = group.group_name
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        for dtype in dtypes:
            buf = symm_mem.empty(MAX_BYTES // dtype.itemsize, dtype=dtype, device=device)
            symm_mem.rendezvous(buf, self.group_name)
            self.buffers[dtype] = buf
        self._op = torch.ops.symm_mem.one_shot_all_reduce_copy_out
        self.fuse_norm = FUSED_ALL_REDUCE_NORM.get()
        self.gemv_push = GEMV_PUSH.get()
        # The partial sum a GEMV has pushed for the next add_rms_norm call (lamport_push).
        self._pushed: torch.Tensor | None = None
        self.pushes = 0  # GEMV calls set up to push (host side; a graph replays them)
        if self.fuse_norm:
            self.rank = dist.get_rank(group)
            world = dist.get_world_size(group)
            norm_buf = symm_mem.empty(2 * world * NORM_SLOT_BYTES, dtype=torch.uint8, device=device)
            norm_buf.fill_(0xFF)  # the kernel's "not yet written" (all bytes 0xFF)
            self.norm_bufs = _peer_addresses(
                norm_buf, symm_mem.rendezvous(norm_buf, self.group_name)
            )
            self.norm_epochs = torch.zeros(NORM_MAX_PROGRAMS, dtype=torch.int64, device=device)
            self._norm_shape: tuple[int, int] | None = None  # (row width, element size)
            self.norm_buf = norm_buf  # this rank's (all_reduce_norm writes it too)
            # No rank may write into a peer's buffer before that peer has filled it.
            torch.cuda.synchronize(device)
            dist.barrier(group)

    def takes(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (
            x.dtype in self.buffers
            and x.is_contiguous()
            and 0 < nbytes <= MAX_BYTES
            and nbytes % _ALIGN == 0
            and x.data_ptr() % _ALIGN == 0
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``x`` (a new tensor); ``takes(x)`` must hold."""
        out = torch.empty_like(x)
        n = x.numel()
        self._op(self.buffers[x.dtype][:n], x.view(-1), "sum", self.group_name, out.view(-1))
        return out

    def takes_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """Whether ``add_rms_norm`` can take these (else: all-reduce, then the norm)."""
        from minisgl.extensions.peer_memory.kernels.all_reduce_norm import programs

        takes = (
            self.fuse_norm
            and x.is_cuda
            and x.dim() == 2
            and x.dtype in _NORM_DTYPES
            and x.stride(1) == 1
            and x.numel() * x.element_size() <= NORM_SLOT_BYTES
            and programs(x.shape[0], x.shape[1]) <= NORM_MAX_PROGRAMS
            and (residual is None or residual.stride(1) == 1)
        )
        # Rows already pushed must be consumed by this kernel, or a peer would read them as
        # the rows of a later call.
        assert takes or self._pushed is None, "pushed rows left to an unfused all-reduce"
        return takes

    def lamport_push(self, rows: int, n_cols: int, dtype: torch.dtype) -> LamportPush | None:
        """Where a GEMV whose [rows, n_cols] result goes straight into `add_rms_norm` may
        push that result to the peers itself (then `mark_pushed` it), or None: off, or a
        shape the fused all-reduce has not been set up for."""
        if not (self.fuse_norm and self.gemv_push) or dtype not in _NORM_DTYPES:
            return None
        if self._norm_shape != (n_cols, dtype.itemsize):
            return None
        if rows * n_cols * dtype.itemsize > NORM_SLOT_BYTES:
            return None
        from minisgl.extensions.peer_memory.kernels.all_reduce_norm import LamportPush
        from minisgl.kernels.norm import row_tile

        assert self._pushed is None, "a GEMV pushed rows that no all-reduce consumed"
        own = self.norm_buf.view(dtype)
        slot_elems = NORM_SLOT_BYTES // dtype.itemsize
        block_m = row_tile(n_cols)[0]
        return LamportPush(own, self.norm_bufs, self.norm_epochs, slot_elems, self.rank, block_m)

    def pushed_gemv(
        self, x: torch.Tensor, weight: torch.Tensor, tiles: GemvTiles
    ) -> torch.Tensor | None:
        """x weight^T for one row, by the GEMV that pushes its result for the next
        `add_rms_norm` (which then only polls); None where `lamport_push` gives no place."""
        if not x.is_cuda or x.dim() != 2 or x.shape[0] != 1:
            return None
        lamport = self.lamport_push(x.shape[0], weight.shape[0], x.dtype)
        if lamport is None:
            return None
        from minisgl.extensions.peer_memory.kernels.pushing_gemv import pushing_gemv

        y = pushing_gemv(x, weight, tiles, lamport)
        self.mark_pushed(y)
        return y

    def mark_pushed(self, y: torch.Tensor) -> None:
        """``y`` was pushed (`lamport_push`): the next `add_rms_norm` must be on it."""
        self._pushed = y
        self.pushes += 1

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(s + residual) * weight, s + residual), s the sum of ``x`` over ranks."""
        from minisgl.extensions.peer_memory.kernels.all_reduce_norm import (
            all_reduce_add_rms_norm,
        )

        # Program p owns the same elements of a slot in every call only if every call has the
        # same row width and element size: a mixed width would let a peer write a region
        # that another program of this rank has not reset yet (kernels/all_reduce_norm.py).
        shape = (x.shape[1], x.element_size())
        if self._norm_shape is None:
            self._norm_shape = shape
        assert shape == self._norm_shape, f"fused all-reduce rows {shape} != {self._norm_shape}"
        pushed = self._pushed is not None
        assert not pushed or self._pushed is x, "pushed rows are not this all-reduce's"
        self._pushed = None
        slot_elems = NORM_SLOT_BYTES // x.element_size()
        bufs = (self.norm_buf, self.norm_bufs, self.norm_epochs, slot_elems)
        return all_reduce_add_rms_norm(x, residual, weight, eps, *bufs, self.rank, pushed)


# PyTorch keeps symmetric-memory state per group name, and a process's next TP run gets
# the same name for a new group: its rendezvous then waits on the old group and hangs
# (seen on two H200s). So one TP run per process uses it; a later one keeps NCCL.
_used_in_process = False


def open_reducer(device: torch.device, dtypes: tuple[torch.dtype, ...]) -> PeerAllReduce | None:
    """Every rank calls it once after joining the group (collective), on CUDA; None on every
    rank unless all can take part (first TP run in its process) and, on this rank, the
    buffers could be made (peer access, a recent PyTorch): setup_reducer then agrees on the
    result, so that no rank waits in the kernel for a peer that is not in it."""
    global _used_in_process
    if not all_ranks_agree(not _used_in_process, device):
        logger.info("a TP run in this process used peer memory before: all-reduce via NCCL")
        return None
    _used_in_process = True
    try:
        comm = PeerAllReduce(device, dtypes)
    except Exception as e:  # noqa: BLE001 - any failure means: use NCCL
        logger.warning("peer-memory all-reduce unavailable (%s); using NCCL", e)
        return None
    return comm
