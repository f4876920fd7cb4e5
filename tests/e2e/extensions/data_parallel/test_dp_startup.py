"""``--dp-size`` refuses what cannot run before any replica loads a model: a busy --port."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.e2e.server_utils import REPO

pytest.importorskip("sglang_router")


def test_busy_port_fails_before_the_replicas_start() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = [sys.executable, "-m", "minisgl", "--dp-size", "2", "--port", str(port)]
        run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in run.stderr, run.stderr[-2000:]
    assert "replica 0" not in run.stderr
