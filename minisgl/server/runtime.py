"""The child processes of one server run: start them (spawn), wait for each to report ready,
watch for one dying, and stop them all.

    tokenizer:       tokenizes requests, detokenizes outputs (minisgl/tokenizer/worker.py)
    scheduler-tp{r}: Engine + Scheduler loop of TP rank r (minisgl/server/scheduler_process.py)
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_sentinels
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from pathlib import Path

from minisgl.config import EngineConfig
from minisgl.ipc.child import ChildReport
from minisgl.ipc.messages import JSONDict
from minisgl.ipc.sockets import IpcAddresses

logger = logging.getLogger("minisgl.server")

STARTUP_TIMEOUT_S = 1800.0  # first run may download a model
STOP_GRACE_S = 5.0
RELEASE_WAIT_S = 2.0  # how long the other TP ranks get to leave once rank 0 released them


class StartupError(RuntimeError):
    pass


@dataclass
class Runtime:
    """The child processes of one server run, and the directory holding their sockets."""

    run_dir: Path
    addresses: IpcAddresses
    procs: dict[str, BaseProcess] = field(default_factory=dict)
    infos: dict[str, JSONDict] = field(default_factory=dict)
    failure: str | None = None
    stopping: bool = False

    @classmethod
    def start(
        cls, config: EngineConfig, log_level: str, max_queued_requests: int | None = None
    ) -> Runtime:
        from minisgl.distributed.topology import Topology, with_init_addr
        from minisgl.server.scheduler_process import SchedulerArgs, run_scheduler
        from minisgl.tokenizer.worker import WorkerArgs, run_worker

        config = with_init_addr(config)  # one node: the ranks meet at a free local port
        topo = Topology.of(config)
        run_dir = Path(tempfile.mkdtemp(prefix="minisgl-"))
        logger.info("run directory (sockets, tokenizer copy): %s", run_dir)
        rt = cls(run_dir, IpcAddresses.in_dir(run_dir))
        ctx = mp.get_context("spawn")
        reports = ctx.Queue()
        copy_dir = str(run_dir / "tokenizer")
        pid = os.getpid()
        try:
            targets: dict[str, tuple[Callable[..., None], object]] = {
                f"scheduler-tp{rank}": (
                    run_scheduler,
                    SchedulerArgs(
                        config, rt.addresses, copy_dir, pid, rank, log_level, max_queued_requests
                    ),
                )
                for rank in topo.node_ranks
            }
            if topo.holds_rank0:  # only node 0 talks to clients
                targets["tokenizer"] = (
                    run_worker,
                    WorkerArgs(
                        config.model, config.tokenizer, rt.addresses, copy_dir, pid, log_level
                    ),
                )
            for name, (target, args) in targets.items():
                proc = ctx.Process(
                    target=target, args=(args, reports), name=f"minisgl-{name}", daemon=True
                )
                proc.start()
                rt.procs[name] = proc
            rt._wait_ready(reports)
        except BaseException:
            rt.shutdown()
            raise
        return rt

    def _wait_ready(self, reports: Queue[ChildReport]) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(self.infos) < len(self.procs):
            report = self._next_report(reports, deadline)
            if not report.ok:
                raise StartupError(f"{report.name} failed to start:\n{report.error}")
            logger.info("%s ready (pid %d)", report.name, self.procs[report.name].pid)
            self.infos[report.name] = report.info

    def _next_report(self, reports: Queue[ChildReport], deadline: float) -> ChildReport:
        while True:
            try:
                return reports.get(timeout=0.5)
            except queue.Empty:
                pass
            dead = [n for n, p in self.procs.items() if n not in self.infos and not p.is_alive()]
            if dead:
                try:  # a child that fails reports why before it exits: prefer its own words
                    return reports.get(timeout=1.0)
                except queue.Empty:
                    code = self.procs[dead[0]].exitcode
                    msg = f"{dead[0]} exited with code {code} during startup"
                    raise StartupError(msg) from None
            if time.monotonic() > deadline:
                raise StartupError(f"children not ready after {STARTUP_TIMEOUT_S:.0f}s")

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call ``on_death(reason)`` (from a thread) when any child exits unexpectedly."""

        def run() -> None:
            sentinels = {proc.sentinel: name for name, proc in self.procs.items()}
            ready = wait_sentinels(list(sentinels))
            if self.stopping:
                return
            name = sentinels[ready[0]]  # type: ignore[index]
            code = self.procs[name].exitcode
            self.failure = f"the {name} process died (exit code {code})"
            logger.error("%s; shutting down", self.failure)
            on_death(self.failure)

        threading.Thread(target=run, name="minisgl-watchdog", daemon=True).start()

    def wait_all(self) -> int:
        """Block until every child has exited: 0 if all exited cleanly; 1 as soon as one
        fails (the caller then stops the rest)."""
        while True:
            codes = {p.sentinel: p.exitcode for p in self.procs.values()}
            if any(code not in (None, 0) for code in codes.values()):
                return 1
            running = [sentinel for sentinel, code in codes.items() if code is None]
            if not running:
                return 0
            wait_sentinels(running)  # the codes read once: an empty list would wait forever

    def shutdown(self) -> None:
        """Stop every child, rank 0 (and the tokenizer) first: told to stop (SIGTERM), rank 0
        leaves its loop and releases the other ranks, here and on other nodes, which then exit
        on their own. A rank stopped before that would make the release fail."""
        self.stopping = True
        deadline = time.monotonic() + STOP_GRACE_S
        followers = {n: p for n, p in self.procs.items() if _is_follower_rank(n)}
        self._stop({n: p for n, p in self.procs.items() if n not in followers}, deadline)
        # Released by rank 0, the other ranks need a moment to leave (and to pass the word on).
        patience = RELEASE_WAIT_S if "scheduler-tp0" in self.procs else 0.0
        self._stop(followers, deadline, patience)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    @staticmethod
    def _stop(procs: dict[str, BaseProcess], deadline: float, patience: float = 0.0) -> None:
        """Let ``procs`` exit on their own for up to ``patience`` seconds, then terminate
        them; kill those still alive at ``deadline``."""
        patient_until = min(deadline, time.monotonic() + patience)
        for proc in procs.values():
            proc.join(max(0.0, patient_until - time.monotonic()))
        for proc in procs.values():
            if proc.is_alive():
                proc.terminate()
        for name, proc in procs.items():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                logger.warning("%s did not stop within %.0fs; killing it", name, STOP_GRACE_S)
                proc.kill()
                proc.join(1.0)
            logger.debug("%s exited with code %s", name, proc.exitcode)


def _is_follower_rank(name: str) -> bool:
    return name.startswith("scheduler-tp") and name != "scheduler-tp0"
