"""All-reduce providers: a faster way than the process group's for some all-reduces of a TP
run, registered by an extension (minisgl/extensions/peer_memory: GPU peer memory).

The layers reach one through this module only: `all_reduce` (distributed/__init__.py) for
plain sums, RMSNorm for a sum fused with the residual add and norm that follow it, and
RowParallelLinear for a batch-1 partial product that the reducer sends to the peers
itself. Without one (none registered, none set up, or it declines a tensor) the process
group sums (NCCL on CUDA, gloo on CPU).

Setup is collective: once the group is joined every rank calls `setup_reducer`, which asks
each registered factory in turn; a reducer is used only if every rank got one, since a rank
in another kernel than its peers would wait for them for ever.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from minisgl.extension_loader import load_extensions

if TYPE_CHECKING:
    import torch

    from minisgl.config import EngineConfig
    from minisgl.kernels import GemvTiles

logger = logging.getLogger(__name__)


class Reducer(Protocol):
    def takes(self, x: torch.Tensor) -> bool:
        """Whether `__call__` sums ``x`` (else the process group does)."""
        ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks, a new tensor."""
        ...

    def takes_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """Whether `add_rms_norm` takes these (else: all-reduce, then the norm)."""
        ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(s + residual) * weight, s + residual), s the sum of ``x`` over ranks."""
        ...

    def pushed_gemv(
        self, x: torch.Tensor, weight: torch.Tensor, tiles: GemvTiles
    ) -> torch.Tensor | None:
        """x weight^T: this rank's partial sum of a row-parallel product without bias,
        computed (with these GEMV tiles) so that it also reaches the peers for the
        `add_rms_norm` that must come next, on it; None where it does not (then the layer
        computes it as usual)."""
        ...


class ReducerFactory(Protocol):
    def __call__(self, config: EngineConfig, device: torch.device) -> Reducer | None:
        """Collective (every rank calls it, with the same configuration): a reducer for the
        joined process group, or None (not on this device, turned off, or unavailable)."""
        ...


_factories: list[ReducerFactory] = []
_active: Reducer | None = None


def register_reducer(factory: ReducerFactory) -> None:
    _factories.append(factory)


def active_reducer() -> Reducer | None:
    return _active


def setup_reducer(config: EngineConfig, device: torch.device) -> None:
    """After joining the process group (collective): the first registered reducer that every
    rank gets, or none."""
    global _active
    _active = None
    load_extensions()
    fewest, most = _min_max(len(_factories), device)
    if fewest != most:  # the ranks would pair one rank's setup collectives with others
        raise RuntimeError(
            f"the TP ranks registered {fewest} to {most} all-reduce providers: install the "
            "same minisgl extensions on every node"
        )
    for factory in _factories:
        reducer = factory(config, device)
        if all_ranks_agree(reducer is not None, device):
            logger.info("TP all-reduces: %s where it takes them", type(reducer).__name__)
            _active = reducer
            return


def reset_reducer() -> None:
    """Forget the reducer (its process group is being destroyed)."""
    global _active
    _active = None


def all_ranks_agree(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on every rank (collective)."""
    return _min_max(int(flag), device)[0] == 1


def _min_max(value: int, device: torch.device) -> tuple[int, int]:
    """The least and the greatest of every rank's ``value`` (collective)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value, -value], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    low, neg_high = t.tolist()
    return int(low), -int(neg_high)
