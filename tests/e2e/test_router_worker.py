"""A minisgl server registers with SGLang's router (sglang-router) under its real model id,
and answers through it."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.server_utils import QUESTION, ServerHandle, free_port, http, wait_until

pytest.importorskip("sglang_router")


@pytest.fixture(scope="module")
def router(default_server: ServerHandle) -> Iterator[str]:
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="minisgl-router-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--worker-urls", default_server.base_url]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def registered() -> bool:
        try:
            status, body = http("GET", url + "/v1/models", timeout=2)
        except OSError:
            return False
        return status == 200 and len(body["data"]) == 1

    try:
        assert wait_until(registered, 60), log.read_text(errors="replace")[-3000:]
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.unlink(missing_ok=True)


def test_router_registers_the_served_model(router: str) -> None:
    status, models = http("GET", router + "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["smollm2"], models
    status, workers = http("GET", router + "/workers")
    assert status == 200 and workers["workers"][0]["model_id"] == "smollm2", workers


def test_chat_and_flush_through_the_router(router: str, default_server: ServerHandle) -> None:
    body = {"model": "smollm2", "messages": QUESTION, "max_tokens": 4, "temperature": 0}
    status, direct = default_server.post("/v1/chat/completions", body)
    assert status == 200, direct
    status, routed = http("POST", router + "/v1/chat/completions", body)
    assert status == 200, routed
    assert routed["choices"][0]["message"] == direct["choices"][0]["message"]
    status, flushed = http("POST", router + "/flush_cache")
    assert status == 200 and flushed["workers_flushed"] == 1, flushed
