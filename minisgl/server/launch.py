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
import signal
import socket
import time
from types import FrameType
from typing import TYPE_CHECKING

from minisgl.config import EngineConfig
from minisgl.ipc.child import LOG_FORMAT
from minisgl.server.args import ServerArgs
from minisgl.server.runtime import Runtime, StartupError

if TYPE_CHECKING:
    from minisgl.server.shutdown import GracefulServer
    from minisgl.server.state import ServerState

logger = logging.getLogger("minisgl.server")


def default_served_name(config: EngineConfig) -> str:
    if config.model is None:
        from minisgl.models.default_model import DEFAULT_GGUF_NAME

        return DEFAULT_GGUF_NAME.split(".")[0]
    return config.model


def tokenizer_path(config: EngineConfig, runtime: Runtime, model_path: str) -> str:
    """What routers load the tokenizer from: the one given, else the model's; a GGUF file
    holds no Hugging Face tokenizer, so then the copy the tokenizer worker saved."""
    if config.tokenizer is not None:
        return config.tokenizer
    return str(runtime.run_dir / "tokenizer") if model_path.endswith(".gguf") else model_path


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


class StopSignal(Exception):
    """Raised by our SIGTERM handler so that cleanup runs."""


def raise_stop(signum: int, frame: FrameType | None) -> None:
    raise StopSignal()


def serve(config: EngineConfig, args: ServerArgs) -> int:
    """Run the server until Ctrl-C/SIGTERM (exit code 0) or a child dies (exit code 1)."""
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    signal.signal(signal.SIGTERM, raise_stop)
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
    except (KeyboardInterrupt, StopSignal):
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
        ranks = sorted(runtime.procs)
        addr = config.dist_init_addr
        logger.info(
            "node %d: TP ranks %s ready; node 0 (%s) serves the API", config.node_rank, ranks, addr
        )
        return runtime.wait_all()
    except (KeyboardInterrupt, StopSignal):
        return 0
    except StartupError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        if runtime is not None:
            runtime.shutdown()


def _make_server(
    config: EngineConfig, args: ServerArgs, runtime: Runtime, started: float, port: int
) -> tuple[GracefulServer, ServerState]:
    import uvicorn

    from minisgl.server.app import create_app
    from minisgl.server.chat_hooks import chat_hook
    from minisgl.server.frontend import Frontend
    from minisgl.server.observers import make_observers
    from minisgl.server.shutdown import GracefulServer
    from minisgl.server.state import ModelInfo, ServerState

    engine_info = runtime.infos["scheduler-tp0"]
    info = ModelInfo(
        served_model_name=args.served_model_name or default_served_name(config),
        model_path=str(engine_info["model_path"]),
        context_length=int(str(engine_info["context_length"])),
        tokenizer_path=tokenizer_path(config, runtime, str(engine_info["model_path"])),
        tp_size=config.tp_size,
        engine=engine_info,
    )
    frontend = Frontend(
        runtime.addresses, make_observers(), args.request_timeout, args.health_timeout
    )
    state = ServerState(info, frontend, int(time.time()), chat_hook(args))

    def on_started() -> None:
        from minisgl.ipc.child import freeze_startup_heap

        freeze_startup_heap()  # uvicorn and the app are loaded by now
        took = time.perf_counter() - started
        name = info.served_model_name
        logger.info(
            "minisgl serving %s at http://%s:%d (startup took %.1fs)", name, args.host, port, took
        )

    app = create_app(
        state, on_started, api_key=args.api_key, max_request_bytes=args.max_request_bytes
    )
    # timeout_graceful_shutdown bounds only the last step, sending the answers of requests
    # that were already finished or aborted: the drain itself is GracefulServer's job.
    cfg = uvicorn.Config(
        app, log_level=args.log_level.lower(), timeout_graceful_shutdown=3, access_log=False
    )
    return GracefulServer(cfg, frontend, args.shutdown_timeout), state
