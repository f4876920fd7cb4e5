"""The core server and the offline API without each server-side extension (its package made
unimportable, as if removed): the server starts and serves chat, completions and /generate;
offline generation works; what the extension adds is refused with a clear error (an unknown
route is a 404, an unknown flag names itself, a request field names itself)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.server_utils import (
    BLOCK_EXTENSIONS,
    REPO,
    ServerHandle,
    assert_clean_log,
    start_server,
    wait_idle_and_check,
    without_extensions,
)

CHAT = {"messages": [{"role": "user", "content": "t5 t6"}], "max_tokens": 3, "ignore_eos": True}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
# Offline generation with the extensions named in argv[1] blocked, the model at argv[2].
OFFLINE = BLOCK_EXTENSIONS + (
    "from minisgl.llm import LLM; from minisgl.sampling_params import SamplingParams; "
    "params = SamplingParams(max_tokens=3, ignore_eos=True); "
    "out = LLM(sys.argv[2]).generate([[5, 6, 7]], params); "
    "assert len(out[0]['token_ids']) == 3, out"
)


def _serves_the_core(server: ServerHandle) -> None:
    status, chat = server.post("/v1/chat/completions", CHAT)
    assert status == 200 and chat["usage"]["completion_tokens"] == 3, chat
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}
    status, text = server.post("/v1/completions", body)
    assert status == 200 and text["choices"][0]["finish_reason"] == "length", text
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    status, native = server.post("/generate", body)
    assert status == 200 and len(native["output_ids"]) == 3, native


@pytest.mark.parametrize("name", ["metrics", "responses", "structured_output"])
def test_the_core_without_one_extension(tiny_model: Path, name: str) -> None:
    server = start_server(["--model", str(tiny_model)], without=[name])
    try:
        assert f"extension {name} is not loaded" in server.log()
        _serves_the_core(server)
        if name == "metrics":
            assert server.get("/metrics")[0] == 404
        elif name == "responses":
            assert server.post("/v1/responses", {"input": "t5", "max_output_tokens": 2})[0] == 404
        else:
            status, body = server.post("/v1/chat/completions", {**CHAT, "tools": [WEATHER]})
            assert status == 400 and body["error"]["param"] == "tools", body
            assert "structured_output" in body["error"]["message"]
            # Tools the client itself turned off are no error.
            none = {**CHAT, "tools": [WEATHER], "tool_choice": "none"}
            assert server.post("/v1/chat/completions", none)[0] == 200
        wait_idle_and_check(server)
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()[-3000:]
    assert_clean_log(server)
    offline = subprocess.run(
        [sys.executable, "-c", OFFLINE, name, str(tiny_model)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert offline.returncode == 0, offline.stderr[-3000:]


def test_an_extension_flag_without_its_extension_is_refused() -> None:
    """--reasoning-parser belongs to the structured_output extension: without it the command
    line names the flag and says which extensions are loaded."""
    cmd = [*without_extensions(["structured_output"]), "--reasoning-parser", "qwen3"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "unrecognized arguments: --reasoning-parser qwen3" in proc.stderr
    assert "extensions loaded: metrics, responses, speculative" in proc.stderr
