"""The process of one follower rank (rank >= 1) of an offline TP run.

It builds the same Engine and Scheduler as rank 0 (its own weight shard), then applies the
call stream rank 0 broadcasts (`minisgl.tp.mirror.follow`) until told to stop. It
leaves when rank 0 says stop, when its parent process dies (polled: the spawning thread may
end before the process does, so PR_SET_PDEATHSIG is not used), or when a collective fails
because a peer died.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from functools import partial

from minisgl.config import EngineConfig
from minisgl.ipc.child import run_child

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.5
LOG_FORMAT = "%(asctime)s %(levelname)s [tp{rank}] %(name)s: %(message)s"


@dataclass(frozen=True)
class RankArgs:
    config: EngineConfig
    rank: int
    parent_pid: int
    log_level: str = "warning"


def run_rank(args: RankArgs) -> None:
    """Entry point of a spawned follower rank."""
    _setup(args)
    # Leaves through os._exit: interpreter teardown with torch and gloo loaded takes seconds
    # and can block on the groups' threads.
    run_child(lambda: follow_offline(args.config, args.rank))


def follow_offline(config: EngineConfig, rank: int) -> None:
    from minisgl.distributed import TPInfo
    from minisgl.distributed.channel import EventChannel
    from minisgl.engine.engine import Engine
    from minisgl.scheduler.scheduler import Scheduler
    from minisgl.scheduler.stop import TokenizerDecoder
    from minisgl.tokenizer import load_tokenizer
    from minisgl.tp import leave_tp_group
    from minisgl.tp.mirror import RankState, follow

    tp = TPInfo(rank, config.tp_size)
    engine = Engine(config, tp)
    load = partial(load_tokenizer, engine.resolved, config.tokenizer)  # if a request needs it
    scheduler = Scheduler(engine, decode=TokenizerDecoder(load=load))
    channel = EventChannel(tp)
    channel.handshake("offline")
    logger.info("rank %d ready on %s", rank, engine.device)
    follow(RankState(scheduler, rank), channel)
    leave_tp_group()


def _setup(args: RankArgs) -> None:
    log_format = LOG_FORMAT.format(rank=args.rank)
    logging.basicConfig(level=args.log_level.upper(), format=log_format, force=True)
    # Ctrl-C reaches the whole process group; rank 0 owns shutdown and stops us itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    threading.Thread(
        target=_exit_with_parent,
        args=(args.parent_pid, args.rank),
        daemon=True,
        name="minisgl-parent-watch",
    ).start()


def _exit_with_parent(parent_pid: int, rank: int) -> None:
    # Once the parent is gone we are re-parented, so getppid() changes.
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    logger.warning("rank %d: parent process %d is gone; exiting", rank, parent_pid)
    os._exit(1)
