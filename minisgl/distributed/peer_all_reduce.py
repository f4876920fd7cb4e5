"""All-reduce of small tensors through GPU peer memory (NVLink) instead of NCCL.

A decode step of a TP model all-reduces two hidden-size rows per layer and token (Qwen3-8B:
72 per step, 8 KB each at batch 1). NCCL's latency for such a message is what bounds the
step, not bandwidth. PyTorch's symmetric memory gives every rank a buffer the others can
read: each rank copies its part in, a barrier, each reads every rank's part and sums them
in rank order (the same sum on every rank), and a closing barrier before the buffer is
reused. One kernel, a few microseconds, capturable in CUDA graphs.

Bigger tensors (prefill) and dtypes the kernel lacks go to NCCL. Two ranks sum a + b
either way, so the result equals NCCL's exactly. ``--disable-custom-all-reduce`` (or no
peer access between the GPUs) keeps NCCL for everything.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# Largest message it takes: a decode batch of 256 rows of a 4,096-wide model is 2 MiB.
MAX_BYTES = 8 * 2**20
_ALIGN = 16  # the kernel's vector width: pointers and sizes must be multiples of it


class PeerAllReduce:
    """One symmetric buffer per dtype, rendezvoused once over the default process group."""

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


_active: PeerAllReduce | None = None


def setup(device: torch.device, dtypes: tuple[torch.dtype, ...]) -> None:
    """Every rank calls it once after joining the group (collective), on CUDA only; on any
    failure (no peer access, an old PyTorch) all ranks keep NCCL."""
    global _active
    import torch.distributed as dist

    ok = True
    try:
        comm = PeerAllReduce(device, dtypes)
    except Exception as e:  # noqa: BLE001 - any failure means: use NCCL
        logger.warning("peer-memory all-reduce unavailable (%s); using NCCL", e)
        ok = False
    # The ranks must agree, or one would wait in NCCL for a peer in the other kernel.
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    _active = comm if ok and int(flag.item()) == 1 else None
    if _active is not None:
        logger.info("all-reduce of up to %d bytes through GPU peer memory", MAX_BYTES)


def active() -> PeerAllReduce | None:
    return _active


def reset() -> None:
    """Forget the buffers (their group is being destroyed)."""
    global _active
    _active = None
