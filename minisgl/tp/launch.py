"""Spawning the TP ranks of one node, and the entry point of nodes other than node 0.

On node 0 the caller is rank 0 (the offline `LLM`, or the server's scheduler); it spawns
ranks ``1 .. R-1`` with `spawn_followers`. Every other node runs all of its ranks as
followers:

    python -m minisgl.tp.launch --model M --tp-size 4 --nnodes 2 --node-rank 1 \\
        --dist-init-addr <node0-host>:<port>

(the same engine flags as node 0; the model must be at the same path on every node).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_sentinels
from multiprocessing.process import BaseProcess

from minisgl.config import EngineConfig
from minisgl.distributed.topology import Topology
from minisgl.tp.rank_worker import RankArgs, run_rank

logger = logging.getLogger(__name__)

STOP_GRACE_S = 10.0


@dataclass
class RankProcesses:
    """Rank processes spawned on this node (``spawn`` start method, daemonic)."""

    procs: dict[int, BaseProcess] = field(default_factory=dict)  # global rank -> process

    @classmethod
    def spawn(
        cls,
        ranks: list[int],
        target: Callable[[RankArgs], None],
        make_args: Callable[[int], RankArgs],
    ) -> RankProcesses:
        ctx = mp.get_context("spawn")
        out = cls()
        try:
            for rank in ranks:
                proc = ctx.Process(
                    target=target, args=(make_args(rank),), name=f"minisgl-tp{rank}", daemon=True
                )
                proc.start()
                out.procs[rank] = proc
        except BaseException:
            out.shutdown(0.0)
            raise
        return out

    @property
    def pids(self) -> dict[int, int | None]:
        return {r: p.pid for r, p in self.procs.items()}

    def failed(self) -> dict[int, int]:
        """Ranks that have exited, with their exit codes."""
        return {r: p.exitcode for r, p in self.procs.items() if p.exitcode is not None}

    def check(self) -> None:
        """Raise if any rank has exited (while the run should be up)."""
        gone = self.failed()
        if gone:
            raise RuntimeError(f"TP rank(s) exited early (rank: exit code): {gone}")

    def wait_any(self, timeout: float | None = None) -> None:
        """Block until some rank exits (or ``timeout`` passes)."""
        if self.procs:
            wait_sentinels([p.sentinel for p in self.procs.values()], timeout)

    def shutdown(self, grace_s: float = STOP_GRACE_S) -> None:
        """Wait up to ``grace_s`` for the ranks to leave on their own, then stop them."""
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for rank, proc in self.procs.items():
            if proc.is_alive():
                logger.warning("rank %d did not exit within %.0fs; terminating it", rank, grace_s)
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)


def spawn_followers(
    config: EngineConfig, log_level: str = "warning", include_rank0: bool = False
) -> RankProcesses:
    """Spawn this node's follower ranks of an offline run (``config.dist_init_addr`` set).

    On node 0 rank 0 is the caller and is skipped unless ``include_rank0``."""
    topo = Topology.of(config)
    ranks = [r for r in topo.node_ranks if r != 0 or include_rank0]
    pid = os.getpid()
    return RankProcesses.spawn(ranks, run_rank, lambda r: RankArgs(config, r, pid, log_level))


def main(argv: list[str] | None = None) -> int:
    """Run every rank of a node other than node 0 until they all exit."""
    import argparse

    from minisgl.config import add_engine_flags, engine_config

    parser = argparse.ArgumentParser(
        prog="python -m minisgl.tp.launch",
        description="Run the TP ranks of one node (node_rank >= 1) of a multi-node run.",
        allow_abbrev=False,
    )
    add_engine_flags(parser)
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    args = parser.parse_args(argv)
    try:
        config = engine_config(args)
    except ValueError as exc:
        parser.error(str(exc))
    if config.node_rank == 0 or config.dist_init_addr is None:
        parser.error(
            "this entry point runs nodes 1..nnodes-1; pass --node-rank and --dist-init-addr"
        )
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s"
    )
    ranks = spawn_followers(config, args.log_level)
    logger.info(
        "node %d: ranks %s running (pids %s)", config.node_rank, list(ranks.procs), ranks.pids
    )
    try:
        # The ranks leave together when rank 0 stops; if one fails, the run is over.
        while len(ranks.failed()) < len(ranks.procs):
            ranks.wait_any()
            if any(code != 0 for code in ranks.failed().values()):
                break
    except KeyboardInterrupt:
        pass
    finally:
        ranks.shutdown()
    codes = ranks.failed()
    logger.info("node %d: ranks exited with %s", config.node_rank, codes)
    return 0 if all(code == 0 for code in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
