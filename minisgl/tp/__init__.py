"""The tensor-parallel runtime: how the ranks of one run are started, kept in step and
stopped. It sits above the scheduler (rank 0 mirrors its scheduler calls to the others,
which run their own), and below the fronts (the offline `LLM`, the shell, the server).
Communication itself (process groups, collectives, the control channel) is
`minisgl.distributed`."""

from __future__ import annotations


def leave_tp_group() -> None:
    """Free this process's TP CUDA graphs, then leave the process groups. Tearing down NCCL
    while graphs that captured its collectives still exist hangs (PyTorch issue 115388)."""
    import torch

    from minisgl.distributed.group import destroy_tp_group

    if torch.cuda.is_available():
        from minisgl.engine.cuda_graph import release_tp_graphs

        release_tp_graphs()
    destroy_tp_group()
