"""Two-rank gloo groups on the CPU for the TP tests: rank 0 in the test process, rank 1 a
spawned process running a follower function of the test module."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from minisgl.config import EngineConfig
from minisgl.distributed.topology import free_port


@contextlib.contextmanager
def rank0_with_follower(
    follower: Any, rank_sync: bool = True
) -> Iterator[tuple[Any, Any, Any, EngineConfig]]:
    """Rank 0 of a two-rank gloo group in this process, ``follower(config, out)`` as rank 1
    in a spawned one; yields rank 0's RankSync (None without ``rank_sync``), rank 1's result
    queue and process, and the config both ranks were started with."""
    import multiprocessing as mp

    import torch

    from minisgl.distributed import TPInfo
    from minisgl.distributed.group import destroy_tp_group, init_tp_group
    from minisgl.tp.server_sync import RankSync

    config = EngineConfig(tp_size=2, dist_init_addr=f"127.0.0.1:{free_port()}")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=follower, args=(config, out), daemon=True)
    proc.start()
    try:
        init_tp_group(config, TPInfo(0, 2), torch.device("cpu"), check=lambda: _alive(proc))
        yield RankSync(TPInfo(0, 2)) if rank_sync else None, out, proc, config
    finally:
        destroy_tp_group()
        if proc.is_alive():
            proc.kill()


def _alive(proc: Any) -> None:
    if proc.exitcode is not None:
        raise RuntimeError(f"rank 1 exited with code {proc.exitcode}")
