"""Real server processes for end-to-end tests: start on a free port, wait for health, stop;
call their routes (with headers), read their metrics, check they end idle and clean."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minisgl import env
from minisgl.env import Switch

REPO = Path(__file__).resolve().parents[2]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(
    method: str, url: str, body: Any = None, raw: bytes | None = None, timeout: float = 120
) -> tuple[int, Any]:
    """(status, parsed JSON or text). ``raw`` sends bytes as they are (malformed JSON tests)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def sse_events(text: str) -> list[Any]:
    """Parse an SSE body, checking the framing: every event is exactly one ``data:`` line,
    named (``event:``) or not, and the body ends with ``data: [DONE]``."""
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = text.split("\n\n")
    assert events[-1] == ""
    out = []
    for ev in events[:-1]:
        # The Responses API names its events: "event: NAME" first, NAME repeated as "type".
        name = None
        if ev.startswith("event: "):
            name, _, ev = ev[len("event: ") :].partition("\n")
        assert ev.startswith("data: ") and "\n" not in ev, ev
        payload = ev[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
        assert name is None or out[-1]["type"] == name, (name, out[-1])
    assert out.count("[DONE]") == 1 and out[-1] == "[DONE]"
    return out[:-1]


@dataclass
class ServerHandle:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    launched_at: float
    ready_at: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def run_dir(self) -> Path:
        found = re.search(r"run directory \(sockets, tokenizer copy\): (\S+)", self.log())
        assert found, "the server did not log its run directory"
        return Path(found.group(1))

    def child_pids(self) -> dict[str, int]:
        return {m[0]: int(m[1]) for m in re.findall(r"(\S+) ready \(pid (\d+)\)", self.log())}

    def get(self, path: str, **kw: Any) -> tuple[int, Any]:
        return http("GET", self.url(path), **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        return http("POST", self.url(path), body, **kw)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


def start_server(
    args: list[str],
    ready_timeout: float = 300,
    switches: dict[Switch[Any], object] | None = None,
    extra_env: dict[str, str] | None = None,
) -> ServerHandle:
    """``python -m minisgl`` with ``args`` on a free port, its environment switches set to
    ``switches`` (and ``extra_env`` on top); returns once it answers /health."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="minisgl-e2e-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "minisgl", "--port", str(port), *args]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            cmd,
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**env.child_environ(switches or {}), **(extra_env or {})},
        )
    handle = ServerHandle(proc, port, log, time.perf_counter())
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{handle.log()[-4000:]}")
        try:
            status, _ = handle.get("/health", timeout=2)
            if status == 200:
                handle.ready_at = time.perf_counter()
                return handle
        except OSError:
            pass
        time.sleep(0.25)
    handle.stop()
    raise RuntimeError(f"server not ready after {ready_timeout}s:\n{handle.log()[-4000:]}")


LOG_PROBLEMS = ("Traceback", "Exception in ASGI application", "unhandled error", "violation")


def assert_clean_log(server: ServerHandle) -> None:
    """Like SGLang's leak harness: a server that served well logged no error at all."""
    log = server.log()
    found = [p for p in LOG_PROBLEMS if p in log]
    assert not found, f"server log mentions {found}:\n{log[-6000:]}"
    server.log_path.unlink(missing_ok=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still "exists"; it is dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def wait_until(predicate: Any, timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def wait_idle_and_check(server: ServerHandle, timeout: float = 60) -> dict[str, Any]:
    """The debug route after the server settles: nothing running or waiting, no live
    request state in any process, and the scheduler's KV integrity check passed."""
    body: dict[str, Any] = {}

    def settled() -> bool:
        nonlocal body
        status, body = server.get("/debug/integrity")
        assert status in (200, 500), body
        return (
            body["running"] == 0
            and body["waiting"] == 0
            and body["live_requests"] == 0
            and body["worker_streams"] == 0
            and body["api_live_requests"] == 0
        )

    assert wait_until(settled, timeout, 0.5), body
    assert body["ok"] is True and body["error"] is None, body
    assert body["free_pages"] + body["evictable_pages"] == body["total_pages"], body
    return body


# ---------------------------------------------------------------- requests with headers
@dataclass
class Reply:
    status: int
    body: Any
    headers: dict[str, str] = field(default_factory=dict)


def request(
    server: ServerHandle,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float = 120,
) -> Reply:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(server.url(path), data=data, method=method)
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, text, hdrs = resp.status, resp.read().decode(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        status, text, hdrs = err.code, err.read().decode(), dict(err.headers)
    try:
        return Reply(status, json.loads(text), hdrs)
    except json.JSONDecodeError:
        return Reply(status, text, hdrs)


def call(
    server: ServerHandle, method: str, path: str, body: Any = None, **kw: Any
) -> tuple[int, Any]:
    reply = request(server, method, path, body, **kw)
    return reply.status, reply.body


def metric(server: ServerHandle, name: str, headers: dict[str, str] | None = None) -> float:
    """The sum of a metric's samples whose name (with labels) starts with ``name``."""
    _, text = call(server, "GET", "/metrics", headers=headers)
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{")
    )


class Authed:
    """A ServerHandle look-alike whose GETs carry the API key (for wait_idle_and_check)."""

    def __init__(self, server: ServerHandle, headers: dict[str, str]) -> None:
        self.server = server
        self.headers = headers

    def get(self, path: str, **kw: Any) -> tuple[int, Any]:
        return call(self.server, "GET", path, headers=self.headers, **kw)


def check_idle(server: ServerHandle, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """Nothing running or live anywhere, and the KV integrity check passes."""
    return wait_idle_and_check(Authed(server, headers or {}))  # type: ignore[arg-type]


def stop_and_check(server: ServerHandle, secret: str | None = None) -> None:
    pids = server.child_pids()
    assert server.stop(signal.SIGTERM) == 0, server.log()[-3000:]
    assert wait_until(lambda: not any(pid_alive(p) for p in pids.values()), 10)
    if secret is not None:
        assert secret not in server.log(), "the API key leaked into the log"
    assert_clean_log(server)


# ---------------------------------------------------------------- data-parallel servers
def start_dp_server(args: list[str], replicas: int, key: str) -> ServerHandle:
    """``python -m minisgl --dp-size N`` with the API key (from the environment, never argv);
    returns once the router has found every replica healthy."""
    server = start_server(
        ["--dp-size", str(replicas), *args], extra_env={env.API_KEY.env_name: key}
    )
    auth = {"Authorization": f"Bearer {key}"}

    def ready() -> bool:
        status, body = call(server, "GET", "/readiness", headers=auth, timeout=5)
        return status == 200 and body.get("healthy_workers") == replicas

    assert wait_until(ready, 120, 0.5), server.log()[-3000:]
    return server


def process_tree(pid: int) -> list[int]:
    """A process and every descendant, to check that none outlives a stop."""
    import psutil

    root = psutil.Process(pid)
    return [pid, *(p.pid for p in root.children(recursive=True))]


def replica_pids(server: ServerHandle) -> dict[int, int]:
    return {int(i): int(p) for i, p in re.findall(r"replica (\d+) \(pid (\d+)\)", server.log())}
