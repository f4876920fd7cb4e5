"""Offline tensor parallelism: the process that calls ``LLM(..., tp_size=N)`` (or the shell)
is rank 0; it spawns ranks 1..N-1, and every scheduler call it makes is mirrored to them
(mirror.py). They exit on ``close()``, at garbage collection, or when this process dies."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

from minisgl.config import EngineConfig
from minisgl.distributed import TPInfo
from minisgl.engine.engine import Engine, pick_device
from minisgl.scheduler.scheduler import Scheduler
from minisgl.scheduler.stop import TokenizerDecoder
from minisgl.tokenizer import Tokenizer, load_tokenizer
from minisgl.tp.launch import RankProcesses
from minisgl.tp.mirror import MirroredScheduler


@dataclass
class OfflineTP:
    engine: Engine
    tokenizer: Tokenizer
    scheduler: MirroredScheduler
    followers: RankProcesses  # the ranks this process spawned
    teardown: Callable[[], None]


def start_offline_tp(config: EngineConfig, owner: object) -> OfflineTP:
    """Rank 0 of an offline TP run; ``owner`` (the LLM) stops the ranks when collected."""
    import torch.distributed

    from minisgl.distributed.channel import EventChannel
    from minisgl.distributed.group import init_tp_group, rank_device
    from minisgl.distributed.topology import with_init_addr
    from minisgl.tp.launch import spawn_followers

    if config.node_rank != 0:
        raise ValueError(
            "LLM(...) is rank 0 and runs on node 0; start the other nodes with "
            "`python -m minisgl.tp.launch --node-rank K ...`"
        )
    if torch.distributed.is_initialized():
        raise RuntimeError("this process is already in a TP run: close() that LLM first")
    config = with_init_addr(config)
    tp = TPInfo(0, config.tp_size)
    device = rank_device(config, tp, pick_device(config.device))  # fail before spawning
    followers = spawn_followers(config)
    holder: dict[str, MirroredScheduler] = {}
    # A finalizer, not __del__: it runs once, at close(), at garbage collection or at
    # interpreter exit, and holds nothing that keeps the owner alive.
    teardown = weakref.finalize(owner, _stop_tp, holder, followers)
    try:
        # Joined here rather than in Engine so that a rank dying at startup fails us now.
        init_tp_group(config, tp, device, check=followers.check)
        engine = Engine(config, tp)
        tokenizer = load_tokenizer(engine.resolved, config.tokenizer)
        channel = EventChannel(tp)
        channel.handshake("offline")
    except BaseException:
        teardown()
        raise
    # Over the tokenizer, not the LLM: the finalizer holds the scheduler, which must not
    # keep the LLM alive.
    mirror = holder["mirror"] = MirroredScheduler(
        Scheduler(engine, decode=TokenizerDecoder(tokenizer)), channel
    )
    return OfflineTP(engine, tokenizer, mirror, followers, teardown)


def _stop_tp(holder: dict[str, MirroredScheduler], followers: RankProcesses) -> None:
    from minisgl.distributed.group import destroy_tp_group
    from minisgl.tp import leave_tp_group

    mirror, stopped = holder.get("mirror"), False
    try:
        stopped = mirror is not None and mirror.stop()
    finally:
        if stopped:
            # Told to stop, the ranks leave the groups and exit. Leaving is collective in
            # NCCL (each rank's teardown waits for the others'): leave with them, then wait
            # for their exit. (Waiting first deadlocked on two GPUs.)
            leave_tp_group()
            followers.shutdown(grace_s=10.0)
        else:
            # Startup failed, or a call failed part-way: the ranks may wait in the
            # rendezvous or a collective. Stop them first.
            followers.shutdown(grace_s=0.0)
            destroy_tp_group()
        holder.clear()  # the mirrored scheduler, and through it the engine
