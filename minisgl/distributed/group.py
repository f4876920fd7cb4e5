"""Process groups of one TP run: the compute group (NCCL on CUDA, gloo on CPU) that the
layers' all-reduce/all-gather use, and a gloo "control" group on which rank 0 sends the
scheduler events to the other ranks.

The control group is separate because its waits are unbounded: a follower blocks on it for as
long as rank 0 is idle (an offline user between ``generate`` calls), which must not trip the
compute group's timeout. A dead peer still fails it at once (gloo sees the socket close).
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from minisgl.config import EngineConfig
from minisgl.distributed import TPInfo
from minisgl.distributed.reducer import reset_reducer, setup_reducer
from minisgl.distributed.topology import Topology, split_addr
from minisgl.env import DIST_TIMEOUT_S

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT = datetime.timedelta(days=365)
_JOINED = "minisgl/joined"  # rendezvous counter: ranks other than 0 that reached the store

_control: dist.ProcessGroup | None = None


def compute_timeout_s() -> float:
    """A collective (or the rendezvous) that waits longer than this means a rank died or the
    ranks diverged: fail instead of hanging. Tests lower it through the environment, which
    spawned ranks inherit."""
    return DIST_TIMEOUT_S.get()


def rank_device(config: EngineConfig, tp: TPInfo, device: torch.device) -> torch.device:
    """Rank ``r`` on CUDA uses its node-local index: ``cuda:{local rank}``."""
    if device.type != "cuda" or tp.size == 1:
        return device
    if device.index is not None:
        raise ValueError(
            f"device={device} names one GPU, but tp_size={tp.size} needs one per rank: pass "
            "--device cuda (rank r uses cuda:<local rank>; pick GPUs with CUDA_VISIBLE_DEVICES)"
        )
    return torch.device("cuda", Topology.of(config).local_rank(tp.rank))


def physical_cores() -> int:
    """Cores (not hardware threads) this process may run on: a second thread of a core adds
    little to memory-bound decoding and contends with the first."""
    cpus = sorted(os.sched_getaffinity(0))
    cores = set()
    for cpu in cpus:
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{topology}/physical_package_id") as pkg, open(f"{topology}/core_id") as c:
                cores.add((pkg.read().strip(), c.read().strip()))
        except OSError:
            return len(cpus)
    return max(1, len(cores))


# torch's thread count when this process started: the physical cores, or what
# OMP_NUM_THREADS asks for (a data-parallel replica's share, a test worker's one thread).
_STARTING_THREADS = torch.get_num_threads()


def share_cpu_threads(config: EngineConfig, device: torch.device) -> None:
    """On CPU, set this process's torch (and OpenMP) threads once: ``--cpu-threads`` (default:
    torch's own count, the physical cores unless OMP_NUM_THREADS says otherwise) shared by the
    node's TP ranks, since oversubscribed threads slow every rank down (and a collective
    waits for the slowest)."""
    if device.type != "cpu":
        return
    total = config.cpu_threads or min(_STARTING_THREADS, physical_cores())
    torch.set_num_threads(max(1, total // Topology.of(config).ranks_per_node))


def init_tp_group(
    config: EngineConfig,
    tp: TPInfo,
    device: torch.device,
    check: Callable[[], None] | None = None,
) -> None:
    """Join the run's process groups (collective: every rank calls it, in the same order).

    Rank 0 waits for the others through the rendezvous store, calling ``check`` (e.g. "did a
    spawned rank die?", which raises) while it waits, so a rank that fails before joining is
    reported at once instead of after the rendezvous timeout."""
    global _control
    if tp.size == 1 or _control is not None:
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds each rank's communicator to this device
    backend = "nccl" if device.type == "cuda" else "gloo"
    if config.dist_init_addr is None:
        raise ValueError("dist_init_addr is unset: rank 0's host:port is needed to meet")
    host, port = split_addr(config.dist_init_addr)
    logger.info("rank %d/%d joining %s at %s:%d", tp.rank, tp.size, backend, host, port)
    timeout = datetime.timedelta(seconds=compute_timeout_s())
    store = dist.TCPStore(
        host, port, tp.size, is_master=tp.is_primary, timeout=timeout, wait_for_workers=False
    )
    if tp.is_primary:
        _wait_for_ranks(store, tp.size - 1, check)
    else:
        store.add(_JOINED, 1)
    dist.init_process_group(
        backend=backend, store=store, rank=tp.rank, world_size=tp.size, timeout=timeout
    )
    _control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    setup_reducer(config, device)


def _wait_for_ranks(store: dist.TCPStore, others: int, check: Callable[[], None] | None) -> None:
    deadline = time.monotonic() + compute_timeout_s()
    while (joined := store.add(_JOINED, 0)) < others:
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {joined} of {others} other TP ranks joined in time")
        time.sleep(0.05)


def control_group() -> dist.ProcessGroup:
    if _control is None:
        raise RuntimeError("the TP process group is not initialised (init_tp_group)")
    return _control


def destroy_tp_group() -> None:
    """Leave the groups, so that this process can start another TP run later."""
    global _control
    _control = None
    reset_reducer()
    if dist.is_initialized():
        dist.destroy_process_group()
