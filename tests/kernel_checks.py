"""Running Triton kernel checks under the interpreter on CPU and natively on CUDA.

triton only honours TRITON_INTERPRET if it is set before its first import, and other test
modules may import triton first. So a test module collects its ``check_*`` functions, runs
them all in one child process started with the variable set (the module run as a script
prints a JSON verdict per check), and each pytest test asserts on its entry. On CUDA the
same checks run in-process under the ``gpu`` marker.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

Check = Callable[[torch.device], None]


class Skip(Exception):
    """Raised by a check that cannot run on this device."""


def collect(namespace: dict[str, Any]) -> dict[str, Check]:
    """The module's ``check_<name>`` functions, by name."""
    return {n.removeprefix("check_"): f for n, f in namespace.items() if n.startswith("check_")}


def run_checks(checks: dict[str, Check], device: torch.device) -> dict[str, str]:
    """name -> "passed", "skipped: why" or "failed: traceback"."""
    results = {}
    for name, fn in checks.items():
        try:
            fn(device)
            results[name] = "passed"
        except Skip as e:
            results[name] = f"skipped: {e}"
        except Exception:
            results[name] = "failed: " + traceback.format_exc()
    return results


@functools.cache
def _child_results(script: str, names: tuple[str, ...]) -> dict[str, str] | str:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, script, *names], env=env, capture_output=True, text=True, timeout=900
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return f"child exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return dict(json.loads(lines[-1]))


def interpreted(script: str, names: tuple[str, ...], name: str) -> None:
    """Assert on check ``name`` of ``script`` run under the interpreter: one child runs the
    file's ``names`` (its everyday checks, or its slow ones)."""
    results = _child_results(script, names)
    outcome = results.get(name, "failed: no result") if isinstance(results, dict) else results
    report(outcome if isinstance(results, dict) else "failed: " + results)


def on_gpu(checks: dict[str, Check], name: str) -> None:
    try:
        checks[name](torch.device("cuda"))
    except Skip as e:
        pytest.skip(str(e))


def report(outcome: str) -> None:
    if outcome.startswith("skipped: "):
        pytest.skip(outcome.removeprefix("skipped: "))
    assert outcome == "passed", outcome


def main(checks: dict[str, Check]) -> None:
    """The child's entry point: run the checks named on the command line (all of them when
    none is named) on the CPU, print the verdicts."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    chosen = {n: f for n, f in checks.items() if n in sys.argv[1:]} if sys.argv[1:] else checks
    print(json.dumps(run_checks(chosen, torch.device("cpu"))))


def make_tests(
    script: str, checks: dict[str, Check], slow: tuple[str, ...] = ()
) -> tuple[Callable[..., None], ...]:
    """A kernel-check module's two pytest tests: every check under the interpreter and, with
    CUDA, natively. Bind them at module level as test_* names. Under the interpreter the
    ``slow`` checks (the ones that repeat another check's kernel path with more dtypes, tiles
    or chunkings) carry the slow marker and run in a child of their own."""
    assert set(slow) <= set(checks), set(slow) - set(checks)
    everyday = tuple(sorted(n for n in checks if n not in slow))
    params = [pytest.param(n, marks=pytest.mark.slow) for n in sorted(slow)]

    @pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no triton")
    @pytest.mark.parametrize("name", [*everyday, *params])
    def test_interpreted(name: str) -> None:
        interpreted(script, tuple(sorted(slow)) if name in slow else everyday, name)

    @pytest.mark.gpu
    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    @pytest.mark.parametrize("name", sorted(checks))
    def test_on_gpu(name: str) -> None:
        on_gpu(checks, name)

    return test_interpreted, test_on_gpu


def assert_no_host_sync(fn: Callable[[], object]) -> None:
    """``fn`` reads no device value on the host (what CUDA graph capture needs): run once to
    compile, then again under torch's synchronization debug mode, which raises on a sync."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
