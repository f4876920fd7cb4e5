"""Every extension can be taken away. With its package made unimportable, in the test's
child process and in every process the server starts (a sitecustomize on PYTHONPATH), the
core starts, serves chat, completions and /generate, generates offline the same greedy
tokens as with every extension, and refuses what the extension adds with an error naming
it: its options offline and on the command line, its routes (404), its request fields (400).

Each package under minisgl/extensions/ needs a probe here (test_every_extension_has_a_probe).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from minisgl import LLM, SamplingParams
from tests.e2e.server_utils import (
    REPO,
    ServerHandle,
    assert_clean_log,
    http,
    start_server,
    wait_idle_and_check,
)

pytestmark = pytest.mark.slow

BLOCKER = """
import importlib.abc, sys
BLOCKED = "minisgl.extensions.{name}"


class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname == BLOCKED or fullname.startswith(BLOCKED + "."):
            raise ImportError(fullname + " is made unimportable by the test")
        return None


sys.meta_path.insert(0, _Block())
"""

PROMPT = [5, 6, 7, 8]
CHAT = {"messages": [{"role": "user", "content": "t5 t6"}], "max_tokens": 3, "ignore_eos": True}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


@dataclass(frozen=True)
class Probe:
    """How the extension's features are asked for. ``offline``: a statement (with ``llm``,
    ``MODEL``, ``QUANTIZED``, ``LLM`` and ``SamplingParams`` in scope) that must raise a
    ValueError containing ``error``. ``flags``: a command line that must fail naming its
    first flag. ``http``: (method, path, body, status, the error's ``param``) answers."""

    offline: str | None = None
    error: str = ""
    flags: tuple[str, ...] = ()
    http: tuple[tuple[str, str, dict[str, object] | None, int, str | None], ...] = ()


PROBES: dict[str, Probe] = {
    "speculative": Probe(
        "LLM(MODEL, speculative_algorithm='ngram')",
        "unknown option(s): speculative_algorithm",
        ("--speculative-algorithm", "ngram"),
    ),
    "structured_output": Probe(
        "llm.generate([[5, 6]], SamplingParams(regex='t[0-9]+'))",
        "regex needs structured output",
        ("--reasoning-parser", "qwen3"),
        (
            ("POST", "/v1/chat/completions", {**CHAT, "tools": TOOLS}, 400, "tools"),
            # Tools the client itself turned off are no error.
            (
                "POST",
                "/v1/chat/completions",
                {**CHAT, "tools": TOOLS, "tool_choice": "none"},
                200,
                None,
            ),
        ),
    ),
    "responses": Probe(http=(("POST", "/v1/responses", {"input": "t5"}, 404, None),)),
    "metrics": Probe(http=(("GET", "/metrics", None, 404, None),)),
    "flashinfer": Probe(
        "LLM(MODEL, attention_backend='flashinfer')", "attention_backend='flashinfer' is invalid"
    ),
    "peer_memory": Probe(
        "LLM(MODEL, disable_custom_all_reduce=True)",
        "unknown option(s): disable_custom_all_reduce",
        ("--disable-custom-all-reduce",),
    ),
    "quantization": Probe(
        "LLM(QUANTIZED)", "quantization_config.quant_method='gptq' is not supported"
    ),
    "data_parallel": Probe(flags=("--dp-size", "2")),
    "hicache": Probe(
        "LLM(MODEL, hicache_size=0.01)",
        "unknown option(s): hicache_size",
        ("--hicache-size", "0.01"),
    ),
}

CHILD = """
import json
from minisgl.extension_loader import loaded_extensions
from minisgl.llm import LLM
from minisgl.sampling_params import SamplingParams

MODEL, QUANTIZED = {model!r}, {quantized!r}
llm = LLM(MODEL)
out = llm.generate([{prompt!r}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
error = None
try:
    exec({offline!r})
except ValueError as exc:
    error = str(exc)
print(json.dumps({{"loaded": loaded_extensions(), "tokens": out[0]["token_ids"], "error": error}}))
"""


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> list[int]:
    """The greedy tokens with every extension loaded."""
    with LLM(str(tiny_model)) as llm:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        return list(llm.generate([PROMPT], params)[0]["token_ids"])


@pytest.fixture(scope="module")
def quantized(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's directory, its config declaring a GPTQ checkpoint."""
    path = tmp_path_factory.mktemp("gptq")
    for f in tiny_model.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _environ(tmp: Path, name: str) -> dict[str, str]:
    (tmp / "sitecustomize.py").write_text(BLOCKER.format(name=name))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp), str(REPO), env.get("PYTHONPATH", "")])
    return env


def _serves_the_core(server: ServerHandle) -> None:
    status, chat = server.post("/v1/chat/completions", CHAT)
    assert status == 200 and chat["usage"]["completion_tokens"] == 3, chat
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}
    status, text = server.post("/v1/completions", body)
    assert status == 200 and text["choices"][0]["finish_reason"] == "length", text
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    status, native = server.post("/generate", body)
    assert status == 200 and len(native["output_ids"]) == 3, native


def test_every_extension_has_a_probe() -> None:
    packages = {p.parent.name for p in (REPO / "minisgl" / "extensions").glob("*/__init__.py")}
    assert packages == set(PROBES), sorted(packages ^ set(PROBES))


@pytest.mark.parametrize("name", sorted(PROBES))
def test_core_runs_without(
    name: str, tiny_model: Path, quantized: Path, reference: list[int], tmp_path: Path
) -> None:
    probe = PROBES[name]
    env = _environ(tmp_path, name)
    code = CHILD.format(
        model=str(tiny_model), quantized=str(quantized), prompt=PROMPT, offline=probe.offline or ""
    )
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert name not in got["loaded"] and got["tokens"] == reference, got
    if probe.offline:
        assert got["error"] is not None and probe.error in got["error"], got
    if probe.flags:
        cmd = [sys.executable, "-m", "minisgl", "--model", str(tiny_model), *probe.flags]
        cli = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert cli.returncode == 2 and probe.flags[0] in cli.stderr, cli.stderr[-2000:]
    server = start_server(["--model", str(tiny_model)], extra_env=env)
    try:
        assert f"extension {name} is not loaded" in server.log()
        _serves_the_core(server)
        for method, path, payload, want, param in probe.http:
            status, body = http(method, server.url(path), payload)
            assert status == want, json.dumps(body)[:2000]
            if param is not None:
                assert body["error"]["param"] == param, body
        wait_idle_and_check(server)
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()[-3000:]
    assert_clean_log(server)
