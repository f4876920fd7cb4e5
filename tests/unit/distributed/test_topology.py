"""Multi-node topology: ranks per node, local ranks, rank 0's node, address parsing, the
flags that set it and the combinations the configuration refuses."""

from __future__ import annotations

import pytest

from minisgl import LLM
from minisgl.cli import build_parser, engine_config
from minisgl.config import EngineConfig
from minisgl.distributed.topology import Topology, split_addr

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("short_dist_timeout")]


def test_topology_and_flags() -> None:
    t = Topology(tp_size=8, nnodes=2, node_rank=1)
    assert t.ranks_per_node == 4 and t.node_ranks == [4, 5, 6, 7]
    assert [t.local_rank(r) for r in (0, 3, 4, 7)] == [0, 3, 0, 3]
    assert t.node_of(5) == 1 and not t.holds_rank0 and Topology(2).holds_rank0
    assert split_addr("10.0.0.1:5000") == ("10.0.0.1", 5000)
    assert split_addr("[::1]:29500") == ("::1", 29500)

    args = build_parser().parse_args(
        ["--tp-size", "4", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:5000"]
    )
    cfg = engine_config(args)
    assert (cfg.tp_size, cfg.nnodes, cfg.node_rank, cfg.dist_init_addr) == (
        4,
        2,
        1,
        "10.0.0.1:5000",
    )
    for bad in (
        {"tp_size": 3, "nnodes": 2, "dist_init_addr": "h:1"},  # nnodes must divide tp_size
        {"tp_size": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"},
        {"tp_size": 2, "nnodes": 2},  # multi-node needs rank 0's address
        {"tp_size": 2, "dist_init_addr": "no-port"},
        {"tp_size": 2, "dist_init_addr": "h:70000"},
        {"nnodes": 0},
    ):
        with pytest.raises(ValueError):
            EngineConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="node 0"):
        LLM(tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1")
