"""The extension's option and environment switches."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.config import option
from minisgl.env import flag

FUSED_ALL_REDUCE_NORM = flag(
    "FUSED_ALL_REDUCE_NORM", True, "CUDA TP: all-reduce, residual add and RMSNorm in one kernel"
)
GEMV_PUSH = flag("GEMV_PUSH", True, "CUDA TP batch 1: the o/down GEMV pushes its rows to peers")


@dataclass(frozen=True)
class PeerMemoryOptions:
    disable_custom_all_reduce: bool = option(
        False,
        "CUDA TP: all-reduce everything through NCCL (default: small tensors through GPU peer "
        "memory, which sums the same)",
    )
