"""The reducer registry (distributed/reducer.py) with the peer-memory extension's reducer:
the ranks of a two-rank gloo group take a reducer together or not at all."""

from __future__ import annotations

from typing import Any

import pytest

from minisgl.config import EngineConfig
from tests.tp_helpers import rank0_with_follower

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("short_dist_timeout")]


def _peer_setup_follower(config: EngineConfig, out: Any) -> None:
    import torch

    from minisgl.distributed import TPInfo
    from minisgl.distributed.group import destroy_tp_group, init_tp_group
    from minisgl.distributed.reducer import active_reducer, register_reducer, setup_reducer
    from minisgl.extension_loader import load_extensions

    load_extensions()  # the same factories, in the same order, as rank 0's
    register_reducer(_rank0_only_reducer)
    init_tp_group(config, TPInfo(1, 2), torch.device("cpu"))
    seen: list[object] = []
    for _ in range(2):
        seen.append(_open_peer_reducer())
        seen.append(_marker_sum(1))
    setup_reducer(config, torch.device("cpu"))
    seen += [active_reducer() is not None, _marker_sum(1)]
    register_reducer(_rank0_only_reducer)  # one provider more than rank 0 has
    try:
        setup_reducer(config, torch.device("cpu"))
    except RuntimeError as e:
        seen.append("same minisgl extensions" in str(e))
    seen.append(_marker_sum(1))
    out.put(seen)
    destroy_tp_group()


def _open_peer_reducer() -> bool:
    """What setup_reducer does with the peer-memory extension's reducer (whose factory
    declines on the CPU before any collective): open it, then agree on the result."""
    import torch

    from minisgl.distributed.reducer import all_ranks_agree
    from minisgl.extensions.peer_memory.peer_all_reduce import open_reducer

    cpu = torch.device("cpu")
    return all_ranks_agree(open_reducer(cpu, (torch.float32,)) is not None, cpu)


def _rank0_only_reducer(config: EngineConfig, device: Any) -> Any:
    import torch.distributed as dist

    return object() if dist.get_rank() == 0 else None


def _marker_sum(rank: int) -> int:
    """A collective after setup: had the ranks' setups taken different collectives, this
    one would pair with a setup's and give another sum (or hang)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([10 * rank + 7])
    dist.all_reduce(t)
    return int(t.item())


def test_reducer_setup_is_agreed_by_every_rank() -> None:
    """The ranks take a reducer (distributed/reducer.py) together or not at all (one rank in
    another kernel would wait for ever). The peer-memory one: rank 0 having used it before
    in its process (rank 1 is fresh), then a buffer that cannot be made (CPU); then a
    reducer that one rank gets and the other not: every time every rank keeps the process
    group's all-reduce, and nobody hangs. Ranks with different providers registered fail
    with a clear error instead of pairing each other's setup collectives."""
    import torch

    from minisgl.distributed import reducer
    from minisgl.extensions.peer_memory import peer_all_reduce

    reducer.register_reducer(_rank0_only_reducer)
    try:
        with rank0_with_follower(_peer_setup_follower, rank_sync=False) as (_, out, proc, cfg):
            peer_all_reduce._used_in_process = True  # a TP run of this process used it
            assert not _open_peer_reducer()
            assert _marker_sum(0) == 24
            peer_all_reduce._used_in_process = False
            assert not _open_peer_reducer()  # no symmetric memory on the CPU
            assert _marker_sum(0) == 24
            reducer.setup_reducer(cfg, torch.device("cpu"))
            assert reducer.active_reducer() is None
            assert _marker_sum(0) == 24
            with pytest.raises(RuntimeError, match="same minisgl extensions"):
                reducer.setup_reducer(cfg, torch.device("cpu"))  # rank 1 has one more
            assert _marker_sum(0) == 24
            assert out.get(timeout=120) == [False, 24, False, 24, False, 24, True, 24]
            proc.join(30)
            assert proc.exitcode == 0
    finally:
        peer_all_reduce._used_in_process = False
        reducer._factories.remove(_rank0_only_reducer)
