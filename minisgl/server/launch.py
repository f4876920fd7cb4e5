"""Start the server: child processes, startup handshake, uvicorn, watchdog, shutdown.

Processes (all children use the ``spawn`` start method):

    main:            API server (FastAPI + uvicorn) + watchdog thread
    tokenizer:       tokenizes requests, detokenizes outputs (minisgl/tokenizer/worker.py)
    scheduler-tp{r}: Engine + Scheduler loop of TP rank r (minisgl/server/scheduler_process.py)

The listening socket is bound first (a busy port fails in milliseconds, not after the model
loads) but not listened on, so connections are refused until every child has reported ready.
Whenever a child dies the server fails pending requests, stops, and exits non-zero.

Multi-node TP: node 0 runs the above with its share of the ranks; every other node runs the
same command with its --node-rank, which starts only that node's scheduler ranks (no HTTP, no
tokenizer) and exits when they do: when node 0 stops (0), or when a rank fails (1).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from multiprocessing.connection import wait as wait_sentinels
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minisgl.config import EngineConfig
from minisgl.ipc.child import LOG_FORMAT, ChildReport
from minisgl.ipc.sockets import IpcAddresses

if TYPE_CHECKING:
    from minisgl.server.state import ServerState

logger = logging.getLogger("minisgl.server")

STARTUP_TIMEOUT_S = 1800.0  # first run may download a model
STOP_GRACE_S = 5.0
RELEASE_WAIT_S = 2.0  # how long the other TP ranks get to leave once rank 0 released them


@dataclass(frozen=True)
class ServerArgs:
    host: str = "127.0.0.1"
    port: int = 1919
    served_model_name: str | None = None
    log_level: str = "info"
    api_key: str | None = field(default=None, repr=False)  # never printed, see __repr__
    max_queued_requests: int | None = None  # waiting requests beyond this get 503
    request_timeout: float | None = None  # seconds from arrival to abort
    health_timeout: float = 60.0  # an unanswered liveness ping makes /health 503 after this
    max_request_bytes: int = 8 << 20
    shutdown_timeout: float = 30.0  # SIGTERM: how long running requests may still take
    reasoning_parser: str | None = None  # chat replies: thinking into reasoning_content

    def __repr__(self) -> str:
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr]
        shown.append(f"api_key={'<set>' if self.api_key else None}")
        return f"ServerArgs({', '.join(shown)})"


class StartupError(RuntimeError):
    pass


@dataclass
class Runtime:
    """The child processes of one server run, and the directory holding their sockets."""

    run_dir: Path
    addresses: IpcAddresses
    procs: dict[str, Any] = field(default_factory=dict)
    infos: dict[str, dict[str, Any]] = field(default_factory=dict)
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
            targets: dict[str, tuple[Callable[..., None], Any]] = {
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

    def _wait_ready(self, reports: Any) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(self.infos) < len(self.procs):
            report = self._next_report(reports, deadline)
            if not report.ok:
                raise StartupError(f"{report.name} failed to start:\n{report.error}")
            logger.info("%s ready (pid %d)", report.name, self.procs[report.name].pid)
            self.infos[report.name] = report.info

    def _next_report(self, reports: Any, deadline: float) -> ChildReport:
        while True:
            try:
                return reports.get(timeout=0.5)  # type: ignore[no-any-return]
            except queue.Empty:
                pass
            dead = [n for n, p in self.procs.items() if n not in self.infos and not p.is_alive()]
            if dead:
                try:  # a child that fails reports why before it exits: prefer its own words
                    return reports.get(timeout=1.0)  # type: ignore[no-any-return]
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
    def _stop(procs: dict[str, Any], deadline: float, patience: float = 0.0) -> None:
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


def default_served_name(config: EngineConfig) -> str:
    if config.model is None:
        from minisgl.models.default_model import DEFAULT_GGUF_NAME

        return DEFAULT_GGUF_NAME.split(".")[0]
    return config.model


def bind_listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {exc}") from None
    sock.set_inheritable(True)
    return sock


class _Stop(Exception):
    """Raised by our SIGTERM handler so that cleanup runs."""


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop()


def serve(config: EngineConfig, args: ServerArgs) -> int:
    """Run the server until Ctrl-C/SIGTERM (exit code 0) or a child dies (exit code 1)."""
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    signal.signal(signal.SIGTERM, _raise_stop)
    started = time.perf_counter()
    runtime: Runtime | None = None
    logger.info("%r", args)  # the API key shows as <set>: logs get shared, keys must not
    logger.info("%r", config)
    if config.node_rank != 0:
        return _serve_node_ranks(config, args)
    try:
        listener = bind_listener(args.host, args.port)
        runtime = Runtime.start(config, args.log_level, args.max_queued_requests)
        server, state = _make_server(config, args, runtime, started, listener.getsockname()[1])

        def on_child_death(reason: str) -> None:  # runs on the watchdog thread
            state.frontend.fail_all(reason)
            server.should_exit = True

        runtime.watch(on_child_death)
        server.run(sockets=[listener])
        if runtime.failure is not None or not server.started:
            return 1
        return 0
    except (KeyboardInterrupt, _Stop):
        return 0 if runtime is None or runtime.failure is None else 1
    except StartupError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        if runtime is not None:
            logger.debug("stopping the child processes")
            runtime.shutdown()


def _serve_node_ranks(config: EngineConfig, args: ServerArgs) -> int:
    """A node other than node 0 of a multi-node TP server: run this node's scheduler ranks
    until they exit. Rank 0 (on node 0) serves HTTP and drives them."""
    runtime: Runtime | None = None
    try:
        runtime = Runtime.start(config, args.log_level)
        logger.info(
            "node %d: TP ranks %s ready; node 0 (%s) serves the API",
            config.node_rank, sorted(runtime.procs), config.dist_init_addr,
        )  # fmt: skip
        return runtime.wait_all()
    except (KeyboardInterrupt, _Stop):
        return 0
    except StartupError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        if runtime is not None:
            runtime.shutdown()


def _make_server(
    config: EngineConfig, args: ServerArgs, runtime: Runtime, started: float, port: int
) -> tuple[Any, ServerState]:
    import uvicorn

    from minisgl.server.app import create_app
    from minisgl.server.frontend import Frontend
    from minisgl.server.metrics import ServerMetrics
    from minisgl.server.shutdown import GracefulServer
    from minisgl.server.state import ModelInfo, ServerState

    engine_info = runtime.infos["scheduler-tp0"]
    info = ModelInfo(
        served_model_name=args.served_model_name or default_served_name(config),
        model_path=engine_info["model_path"],
        context_length=int(engine_info["context_length"]),
        engine=engine_info,
    )
    metrics = ServerMetrics()
    frontend = Frontend(runtime.addresses, metrics, args.request_timeout, args.health_timeout)
    state = ServerState(info, frontend, metrics, int(time.time()), args.reasoning_parser)

    def on_started() -> None:
        from minisgl.ipc.child import freeze_startup_heap

        freeze_startup_heap()  # uvicorn and the app are loaded by now
        logger.info(
            "minisgl serving %s at http://%s:%d (startup took %.1fs)",
            info.served_model_name, args.host, port, time.perf_counter() - started,
        )  # fmt: skip

    app = create_app(
        state, on_started, api_key=args.api_key, max_request_bytes=args.max_request_bytes
    )
    # timeout_graceful_shutdown bounds only the last step, sending the answers of requests
    # that were already finished or aborted: the drain itself is GracefulServer's job.
    cfg = uvicorn.Config(
        app, log_level=args.log_level.lower(), timeout_graceful_shutdown=3, access_log=False
    )
    return GracefulServer(cfg, frontend, args.shutdown_timeout), state
