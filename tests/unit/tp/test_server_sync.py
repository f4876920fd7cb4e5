"""The server's rank sync (tp/server_sync.py) over a two-rank gloo group: every rank gets the
messages rank 0 received, rank 0's settings are shared, and a rank started with other engine
flags is refused by name."""

from __future__ import annotations

from typing import Any

import pytest

from minisgl.config import EngineConfig
from tests.tp_helpers import rank0_with_follower

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("short_dist_timeout")]


def _server_follower(config: EngineConfig, out: Any) -> None:
    """Rank 1 of a `RankSync` test: what the server's non-zero ranks do, minus the model."""
    import torch

    from minisgl.distributed import TPInfo
    from minisgl.distributed.group import destroy_tp_group, init_tp_group
    from minisgl.tp.server_sync import RankSync

    tp = TPInfo(1, 2)
    init_tp_group(config, tp, torch.device("cpu"))
    sync = RankSync(tp)
    seen = []
    while (msgs := sync.exchange()) is not None:
        seen.append(msgs)
        sync.gather(len(msgs))
    out.put(seen)
    destroy_tp_group()


def test_server_rank_sync_hands_every_rank_the_same_messages() -> None:
    with rank0_with_follower(_server_follower) as (sync, out, proc, _):
        sent: list[list[Any]] = [[], [{"rid": 3, "ids": [1, 2]}, ("abort", 3)], [], [{"rid": 4}]]
        for msgs in sent:
            assert sync.exchange(msgs) == msgs
            assert sync.gather(len(msgs)) == [len(msgs), len(msgs)]
        sync.stop()
        assert out.get(timeout=120) == sent
        proc.join(30)
        assert proc.exitcode == 0


def _mismatched_follower(config: EngineConfig, out: Any) -> None:
    """Rank 1 started with another --page-size than rank 0 (as a second node could be)."""
    import dataclasses

    import torch

    from minisgl.distributed import TPInfo
    from minisgl.distributed.group import destroy_tp_group, init_tp_group
    from minisgl.tp.server_sync import RankSync

    init_tp_group(config, TPInfo(1, 2), torch.device("cpu"))
    sync = RankSync(TPInfo(1, 2))
    assert sync.share(None) == 7  # rank 0's value, whatever this rank was given
    try:
        sync.require_same(dataclasses.replace(config, page_size=4), "engine flags")
        out.put("accepted")
    except Exception as exc:
        out.put(str(exc))
    destroy_tp_group()


def test_server_ranks_take_rank0_settings_and_refuse_other_engine_flags() -> None:
    from minisgl.distributed.channel import ProtocolMismatch

    with rank0_with_follower(_mismatched_follower) as (sync, out, proc, config):
        assert sync.share(7) == 7
        with pytest.raises(ProtocolMismatch, match=r"rank 1: page_size=4 \(rank 0: 1\)"):
            sync.require_same(config, "engine flags")
        assert "page_size=4 (rank 0: 1)" in out.get(timeout=120)
        proc.join(30)
        assert proc.exitcode == 0
