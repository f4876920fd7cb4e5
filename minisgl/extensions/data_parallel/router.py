"""SGLang's router as a child process, and the few of its HTTP routes the launcher calls:
/readiness to wait for the replicas to register, /workers to take a dead one out."""

from __future__ import annotations

import json
import shlex
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from minisgl.ipc.child import die_with_parent
from minisgl.server.runtime import StartupError

if TYPE_CHECKING:
    from minisgl.extensions.data_parallel.options import DataParallelOptions
    from minisgl.server.args import ServerArgs

POLL_S = 0.25
READY_TIMEOUT_S = 120.0
# The router logs two lines per request at info: at our info it logs warnings and up.
LOG_LEVELS = {"debug": "debug", "info": "warn", "warning": "warn", "error": "error"}


def router_argv(
    args: ServerArgs, opts: DataParallelOptions, urls: list[str], metrics_port: int
) -> list[str]:
    """sglang-router's flags: ours, then the user's --router-args (argparse keeps the last)."""
    argv = ["--host", args.host, "--port", str(args.port), "--worker-urls", *urls]
    argv += ["--policy", opts.router_policy, "--log-level", LOG_LEVELS[args.log_level]]
    argv += ["--prometheus-host", args.host, "--prometheus-port", str(metrics_port)]
    argv += ["--shutdown-grace-period-secs", str(max(1, round(args.shutdown_timeout)))]
    argv += ["--max-payload-size", str(args.max_request_bytes)]
    return argv + shlex.split(opts.router_args or "")


def run_router(argv: list[str], api_key: str | None) -> None:
    """The router's process. The key goes in here, not in argv: arguments show in ``ps``.
    With it the router sends the key to the replicas (registration, health checks) and
    requires it from clients."""
    from sglang_router.launch_router import launch_router, parse_router_args

    die_with_parent()
    launch_router(replace(parse_router_args(argv), api_key=api_key))


def local_url(host: str, port: int) -> str:
    """Where this machine reaches a server listening on ``host``."""
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{port}"


def call(method: str, url: str, api_key: str | None = None) -> tuple[int, object]:
    req = urllib.request.Request(url, method=method)
    if api_key is not None:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def _wait(ready: Callable[[], bool], proc: BaseProcess, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.exitcode is not None:
            raise StartupError(f"{what} exited with code {proc.exitcode} during startup")
        try:
            if ready():
                return
        except OSError:
            pass  # not listening yet
        time.sleep(POLL_S)
    raise StartupError(f"{what} was not ready after {timeout:.0f}s")


def wait_healthy(url: str, proc: BaseProcess, timeout: float, what: str) -> None:
    _wait(lambda: call("GET", url + "/health")[0] == 200, proc, timeout, what)


def wait_ready(url: str, proc: BaseProcess, replicas: int, api_key: str | None) -> None:
    """Until the router has registered every replica and found it healthy."""

    def ready() -> bool:
        _, body = call("GET", url + "/readiness", api_key)
        return isinstance(body, dict) and body.get("healthy_workers") == replicas

    _wait(ready, proc, READY_TIMEOUT_S, "the router")


def remove_worker(router_url: str, worker_url: str, api_key: str | None) -> bool:
    """Take one replica out of the router's list (False if that failed: the router's own
    health checks and retries then keep requests off it)."""
    try:
        _, listed = call("GET", router_url + "/workers", api_key)
        workers = listed.get("workers", []) if isinstance(listed, dict) else []
        ids = [w["id"] for w in workers if w.get("url") == worker_url]
        return any(call("DELETE", f"{router_url}/workers/{i}", api_key)[0] < 300 for i in ids)
    except OSError:
        return False
