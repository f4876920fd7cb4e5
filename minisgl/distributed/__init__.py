"""Tensor-parallel process group over torch.distributed (NCCL on CUDA, gloo on CPU).

torch is imported where it is used: the API server's process imports this package (for the
rank layout in topology.py) and never runs a collective, so it need not load torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


def all_reduce(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """The sum of ``x`` over the TP ranks: by the reducer set up for the run where it takes
    ``x`` (reducer.py), else in place through the process group."""
    if tp.size > 1:
        from minisgl.distributed.reducer import active_reducer

        reducer = active_reducer()
        if reducer is not None and reducer.takes(x):
            return reducer(x)
        import torch.distributed as dist

        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Concatenate each rank's shard along the last dimension (vocab-parallel LM head)."""
    if tp.size == 1:
        return x
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def init_process_group(
    tp: TPInfo, init_method: str, backend: str, timeout_s: float = 600.0
) -> None:
    import datetime

    import torch.distributed as dist

    if tp.size == 1 or dist.is_initialized():
        return
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=tp.rank,
        world_size=tp.size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
