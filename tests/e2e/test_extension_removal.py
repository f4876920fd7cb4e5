"""Every extension can be taken away: with its package made unimportable (in the test's
process and in every process the server starts, through a sitecustomize on PYTHONPATH), the
core starts, serves a request through the server and offline, and refuses the extension's
options with an error naming them.

Each extension under minisgl/extensions/ needs a probe here (test_every_extension_has_a_probe):
what asking for its feature looks like offline, on the command line and over HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.e2e.server_utils import REPO, http, start_server

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


@dataclass(frozen=True)
class Probe:
    """How the extension's feature is asked for: ``offline`` is Python run after
    ``llm = LLM(MODEL)`` that must raise ValueError naming ``names``; ``flags`` a command line
    that must fail naming them; ``http`` (method, path, body, status) what the server answers
    without it."""

    names: tuple[str, ...]
    offline: str | None = None
    flags: tuple[str, ...] = ()
    http: tuple[str, str, dict[str, object] | None, int] | None = None
    extra: dict[str, str] = field(default_factory=dict)


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
PROBES: dict[str, Probe] = {
    "speculative": Probe(
        ("speculative_algorithm",),
        offline="LLM(MODEL, speculative_algorithm='ngram')",
        flags=("--speculative-algorithm", "ngram"),
    ),
    "structured_output": Probe(
        ("regex",),
        offline="llm.generate([[5, 6]], SamplingParams(regex='t[0-9]+'))",
        flags=("--reasoning-parser", "qwen3"),
        http=(
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "t5"}], "tools": TOOLS, "max_tokens": 2},
            400,
        ),
    ),
}

CHILD = """
import sys
sys.path.insert(0, {repo!r})
from minisgl import LLM, SamplingParams
MODEL = {model!r}
llm = LLM(MODEL)
out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
assert len(out[0]["token_ids"]) == 4, out
print("served offline")
probe = {offline!r}
if probe:
    try:
        exec(probe)
    except ValueError as exc:
        print("refused:", exc)
    else:
        raise SystemExit("the extension's feature was not refused")
"""


def _environ(tmp: Path, name: str) -> dict[str, str]:
    (tmp / "sitecustomize.py").write_text(BLOCKER.format(name=name))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp), str(REPO), env.get("PYTHONPATH", "")])
    return env


def test_every_extension_has_a_probe() -> None:
    packages = {p.parent.name for p in (REPO / "minisgl" / "extensions").glob("*/__init__.py")}
    assert packages and packages <= set(PROBES), sorted(packages - set(PROBES))


@pytest.mark.parametrize("name", sorted(PROBES))
def test_core_runs_without(name: str, tiny_model: Path, tmp_path: Path) -> None:
    probe = PROBES[name]
    env = _environ(tmp_path, name)
    code = CHILD.format(repo=str(REPO), model=str(tiny_model), offline=probe.offline)
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "served offline" in run.stdout
    if probe.offline:
        refused = run.stdout.split("refused:", 1)[1]
        assert all(n in refused for n in probe.names), refused
    if probe.flags:
        cli = subprocess.run(
            [sys.executable, "-m", "minisgl", "--model", str(tiny_model), *probe.flags],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert cli.returncode == 2, cli.stderr[-2000:]
        assert probe.flags[0] in cli.stderr, cli.stderr[-2000:]
    server = start_server(["--model", str(tiny_model)], extra_env=env)
    try:
        status, body = server.post("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3})
        assert status == 200, body
        assert f"extension {name} is not loaded" in server.log()
        if probe.http is not None:
            method, path, payload, want = probe.http
            status, body = http(method, server.url(path), payload)
            assert status == want, json.dumps(body)[:2000]
    finally:
        assert server.stop() == 0, server.log()[-3000:]
