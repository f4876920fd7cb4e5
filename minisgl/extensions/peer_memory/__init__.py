"""All-reduce through GPU peer memory (NVLink) for CUDA TP runs: small all-reduces in one
kernel instead of NCCL's, the all-reduces that feed a residual add + RMSNorm fused with it
(a Lamport exchange), and at batch 1 the GEMV before them pushing its rows to the peers
itself. A reducer of minisgl/distributed/reducer.py (peer_all_reduce.py; kernels/).

Its option ``--disable-custom-all-reduce`` keeps NCCL for everything; its switches
MINISGL_FUSED_ALL_REDUCE_NORM and MINISGL_GEMV_PUSH turn the fused paths off. Registering
imports nothing heavy: the reducer's module (torch) is imported when a TP group is set up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minisgl.config import EngineConfig, OptionGroup, register_options
from minisgl.distributed.reducer import register_reducer
from minisgl.extensions.peer_memory.options import (
    FUSED_ALL_REDUCE_NORM,
    GEMV_PUSH,
    PeerMemoryOptions,
)

if TYPE_CHECKING:
    import torch

    from minisgl.distributed.reducer import Reducer

__all__ = ["FUSED_ALL_REDUCE_NORM", "GEMV_PUSH", "PeerMemoryOptions"]


def make_reducer(config: EngineConfig, device: torch.device) -> Reducer | None:
    if device.type != "cuda" or config.ext(PeerMemoryOptions).disable_custom_all_reduce:
        return None
    import torch

    from minisgl.extensions.peer_memory.peer_all_reduce import open_reducer

    return open_reducer(device, (torch.bfloat16, torch.float32))


register_reducer(make_reducer)
register_options(OptionGroup("custom all-reduce", PeerMemoryOptions))
