"""The processes of a data-parallel server: N replicas (each the one-engine server of
minisgl/server/launch.py, on a free local port) and SGLang's router in front of them.

Start: the replicas first; once each answers /health, the router, with their URLs; serving
once it reports every replica healthy. A replica that exits is logged and removed from the
router, which sends the rest of the traffic to the others; the server stops (exit 1) when no
replica is left or the router exits. SIGTERM drains: the router first (it stops accepting and
lets requests in flight finish, for --shutdown-timeout), then the replicas; nothing is left.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from multiprocessing.connection import wait as wait_sentinels
from multiprocessing.process import BaseProcess

from minisgl.config import EngineConfig
from minisgl.distributed.topology import free_port
from minisgl.env import export
from minisgl.extensions.data_parallel import router
from minisgl.extensions.data_parallel.options import (
    VISIBLE_GPUS,
    DataParallelOptions,
    check_router_installed,
    cpu_threads,
    replica_gpus,
    visible_gpus,
)
from minisgl.ipc.child import LOG_FORMAT, die_with_parent
from minisgl.server.args import ServerArgs
from minisgl.server.launch import StopSignal, bind_listener, raise_stop
from minisgl.server.runtime import STARTUP_TIMEOUT_S, StartupError

logger = logging.getLogger("minisgl.data_parallel")

EXIT_GRACE_S = 15.0  # past the drain, how long a process may take to exit before SIGKILL


def run_replica(config: EngineConfig, args: ServerArgs, env: dict[str, str]) -> None:
    """A replica's process: the one-engine server, on its share of the GPUs or cores."""
    from minisgl.server.launch import serve

    die_with_parent()
    export(env)  # before the engine's processes start: they inherit it
    sys.exit(serve(config, args))


@dataclass
class Replica:
    index: int
    url: str
    process: BaseProcess


@dataclass
class Fleet:
    replicas: list[Replica] = field(default_factory=list)
    router: BaseProcess | None = None

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.process.exitcode is None]

    def stop(self, grace: float) -> None:
        """The router first, so that it drains the requests in flight; then the replicas."""
        procs = [self.router] if self.router is not None else []
        for group in (procs, [r.process for r in self.replicas]):
            for p in group:
                if p.is_alive():
                    p.terminate()
            for p in group:
                p.join(grace + EXIT_GRACE_S)
                if p.is_alive():
                    logger.warning("%s did not stop in time: killing it", p.name)
                    p.kill()
                    p.join()


def plan(config: EngineConfig, dp_size: int) -> list[dict[str, str]]:
    """Each replica's environment: its GPUs on CUDA, its share of the threads on CPU."""
    check_router_installed()
    if config.nnodes > 1:
        raise ValueError("--dp-size > 1 runs on one node: --nnodes must be 1")
    count = 0
    if config.device != "cpu":
        import torch

        count = torch.cuda.device_count()
    gpus = replica_gpus(dp_size, config.tp_size, config.device, visible_gpus(count))
    if gpus is not None:
        return [{VISIBLE_GPUS.env_name: g} for g in gpus]
    threads = cpu_threads(dp_size, config.tp_size, os.cpu_count() or 1)
    return [{"OMP_NUM_THREADS": str(threads)} for _ in range(dp_size)]


def serve_replicas(config: EngineConfig, args: ServerArgs) -> int:
    """Run the replicas and the router until SIGTERM/Ctrl-C (0) or they fail (1); 2 when
    the settings cannot run here."""
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    opts = args.ext(DataParallelOptions)
    try:
        envs = plan(config, opts.dp_size)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    signal.signal(signal.SIGTERM, raise_stop)
    fleet = Fleet()
    try:
        _start(fleet, config, args, envs)
        return _watch(fleet, args)
    except (KeyboardInterrupt, StopSignal):
        return 0
    except StartupError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        # A second signal must not cut the drain short and leave processes behind; the
        # drain is bounded (--shutdown-timeout), and SIGKILL still stops us (and, with us,
        # every replica: they die with their parent).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        fleet.stop(args.shutdown_timeout)


def _start(
    fleet: Fleet, config: EngineConfig, args: ServerArgs, envs: list[dict[str, str]]
) -> None:
    started = time.perf_counter()
    bind_listener(args.host, args.port).close()  # a busy port fails now, not after loading
    opts = args.ext(DataParallelOptions)
    ctx = mp.get_context("spawn")
    others = tuple(e for e in args.extensions if not isinstance(e, DataParallelOptions))
    for i, env in enumerate(envs):
        port = free_port()
        replica_args = replace(args, host="127.0.0.1", port=port, extensions=others)
        proc = ctx.Process(
            target=run_replica, args=(config, replica_args, env), name=f"replica-{i}"
        )
        proc.start()
        fleet.replicas.append(Replica(i, f"http://127.0.0.1:{port}", proc))
        logger.info(
            "replica %d (pid %s) starting at http://127.0.0.1:%d (%s)", i, proc.pid, port, env
        )
    for r in fleet.replicas:
        router.wait_healthy(r.url, r.process, STARTUP_TIMEOUT_S, f"replica {r.index}")
    metrics_port = opts.router_prometheus_port or free_port()
    argv = router.router_argv(args, opts, [r.url for r in fleet.replicas], metrics_port)
    fleet.router = ctx.Process(target=router.run_router, args=(argv, args.api_key), name="router")
    fleet.router.start()
    url = router.local_url(args.host, args.port)
    router.wait_ready(url, fleet.router, len(envs), args.api_key)
    took = time.perf_counter() - started
    logger.info(
        "minisgl serving at http://%s:%d through sglang-router: %d replicas, policy %s, router "
        "metrics at :%d/metrics (startup took %.1fs)",
        *(args.host, args.port, len(envs), opts.router_policy, metrics_port, took),
    )


def _watch(fleet: Fleet, args: ServerArgs) -> int:
    """Until the router exits or no replica is left: log each replica that exits and take
    it out of the router's list, so that no request is sent to it again."""
    assert fleet.router is not None
    url = router.local_url(args.host, args.port)
    while True:
        live = fleet.live()
        wait_sentinels([fleet.router.sentinel, *(r.process.sentinel for r in live)])
        if fleet.router.exitcode is not None:
            logger.error("the router exited (code %s): stopping", fleet.router.exitcode)
            return 1
        for r in live:
            if r.process.exitcode is not None:
                removed = router.remove_worker(url, r.url, args.api_key)
                logger.error(
                    "replica %d (%s, pid %s) exited with code %s: %s the router; %d of %d "
                    "replicas left",
                    *(r.index, r.url, r.process.pid, r.process.exitcode),
                    "removed from" if removed else "could not remove it from",
                    *(len(fleet.live()), len(fleet.replicas)),
                )
        if not fleet.live():
            logger.error("no replica left: stopping")
            return 1
