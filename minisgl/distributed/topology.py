"""Rank arithmetic for tensor parallelism across one or more nodes (no torch import).

Global ranks are laid out node by node: node ``k`` holds ranks ``[k * R, (k + 1) * R)`` with
``R = tp_size // nnodes``; rank 0 (node 0, local rank 0) drives the others and is the only
one that talks to clients. On CUDA, local rank ``i`` uses ``cuda:i``.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, replace

from minisgl.config import EngineConfig


@dataclass(frozen=True)
class Topology:
    tp_size: int
    nnodes: int = 1
    node_rank: int = 0

    @classmethod
    def of(cls, config: EngineConfig) -> Topology:
        return cls(config.tp_size, config.nnodes, config.node_rank)

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def node_ranks(self) -> list[int]:
        """The global ranks that run on this node."""
        r = self.ranks_per_node
        return list(range(self.node_rank * r, (self.node_rank + 1) * r))

    @property
    def holds_rank0(self) -> bool:
        return self.node_rank == 0

    def local_rank(self, rank: int) -> int:
        """Index of ``rank`` on its node: its CUDA device."""
        return rank % self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node


def split_addr(addr: str) -> tuple[str, int]:
    """``host:port`` (IPv6 hosts may be bracketed) -> (host, port)."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"dist_init_addr={addr!r} is not host:port")
    return host.strip("[]"), int(port)


def free_port(host: str = "127.0.0.1") -> int:
    # The port is released before torch binds it; a race with another process is possible
    # but short, and a lost race fails loudly at startup rather than silently.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def with_init_addr(config: EngineConfig) -> EngineConfig:
    """On one node, fill in ``dist_init_addr`` with a free local port if it is unset."""
    if config.tp_size == 1 or config.dist_init_addr is not None:
        return config
    return replace(config, dist_init_addr=f"127.0.0.1:{free_port()}")
