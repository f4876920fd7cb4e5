"""Process lifecycle: a dying child takes the server down (non-zero exit, no hang), startup
errors are reported, a busy port fails before any loading. (The clean SIGTERM stop is checked
by the tiny_server fixture's teardown.)"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.server_utils import REPO, http, pid_alive, start_server, wait_until


def test_dead_scheduler_fails_requests_and_exits_nonzero(tiny_model: Path) -> None:
    server = start_server(["--model", str(tiny_model)])
    pids = server.child_pids()
    result: dict[str, Any] = {}

    def long_request() -> None:
        body = {"text": "t5 t6", "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}
        try:
            result["response"] = http("POST", server.url("/generate"), body, timeout=60)
        except OSError as exc:  # the server may close the connection as it exits
            result["response"] = (None, repr(exc))

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(0.3)
    os.kill(pids["scheduler-tp0"], signal.SIGKILL)
    thread.join(60)
    assert not thread.is_alive(), "the in-flight request hung"
    status, _ = result["response"]
    assert status in (200, 503, None)  # finished just before, or told the engine died
    server.proc.wait(30)
    assert server.proc.returncode == 1, server.log()[-3000:]
    assert "scheduler-tp0 process died" in server.log()
    assert wait_until(lambda: not pid_alive(pids["tokenizer"]), 10)
    server.log_path.unlink()


def test_startup_error_is_reported(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "minisgl", "--model", str(tmp_path / "missing"), "--port", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "failed to start" in proc.stderr and "does not exist" in proc.stderr


def _gemma3_checkpoint(path: Path) -> Path:
    """A Hugging Face directory of an architecture minisgl does not implement: its config (no
    weights: the architecture is refused before any are read) and a working tokenizer, so the
    tokenizer worker starts fine and the only error is the architecture's."""
    from tests.helpers import TINY_BASE, save_tiny_tokenizer

    config = {**TINY_BASE, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"}
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_tiny_tokenizer(path, int(config["vocab_size"]))
    return path


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    """LLM(path) raises a ValueError naming the architecture and the supported ones; the
    server exits 1 with that message on stderr, once, and no traceback (a user's setting,
    not a bug: the traceback is in the child's debug log)."""
    from minisgl import LLM

    model = _gemma3_checkpoint(tmp_path / "gemma3")
    with pytest.raises(ValueError, match="'Gemma3ForCausalLM'.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(model))
    proc = subprocess.run(
        [sys.executable, "-m", "minisgl", "--model", str(model), "--port", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "scheduler-tp0 failed to start" in proc.stderr
    assert proc.stderr.count("unsupported model architecture 'Gemma3ForCausalLM'") == 1
    assert "supported: LlamaForCausalLM" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_busy_port_fails_fast() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "minisgl", "--port", str(port)],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert proc.returncode == 1 and "cannot listen" in proc.stderr
    assert time.monotonic() - start < 30  # before loading any model
