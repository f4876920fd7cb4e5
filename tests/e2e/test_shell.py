"""The interactive shell, driven through a pseudo-terminal with the default model (and with the
tiny one, for tensor parallelism)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pexpect
import pytest

from tests.e2e.server_utils import REPO

PROMPT = ">>> "


def test_shell_answers_and_resets() -> None:
    env = {
        **os.environ,
        "PROMPT_TOOLKIT_NO_CPR": "1",  # pexpect does not answer cursor-position requests
        "TERM": "dumb",
    }
    child = pexpect.spawn(
        sys.executable,
        # Greedy: the same question gets the same answer.
        ["-m", "minisgl", "--shell", "--temperature", "0", "--max-tokens", "16"],
        cwd=str(REPO), env=env,
        encoding="utf-8", timeout=240, dimensions=(40, 200),
    )  # fmt: skip
    try:
        child.expect_exact("/reset clears")
        child.expect_exact(PROMPT)
        child.sendline("What is the capital of France?")
        child.expect_exact(PROMPT, timeout=120)
        first = child.before
        assert "Paris" in first, first
        child.sendline("/reset")
        child.expect_exact("(conversation cleared)")
        child.expect_exact(PROMPT)
        child.sendline("What is the capital of France?")
        child.expect_exact(PROMPT, timeout=120)
        assert "Paris" in child.before, child.before
        child.sendline("/exit")
        child.expect(pexpect.EOF, timeout=30)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before


def _tiny_shell_answer(model: Path, tp: int) -> tuple[str, list[int]]:
    """The shell's greedy answer with the tiny model, and the processes it had started."""
    import psutil

    from minisgl import env as switches

    env = {
        **switches.child_environ({switches.DIST_TIMEOUT_S: 60}),
        "PROMPT_TOOLKIT_NO_CPR": "1",
        "TERM": "dumb",
    }
    child = pexpect.spawn(
        sys.executable,
        ["-m", "minisgl", "--shell", "--model", str(model), "--tp-size", str(tp),
         "--temperature", "0", "--max-tokens", "8"],
        cwd=str(REPO), env=env, encoding="utf-8", timeout=120, dimensions=(40, 200),
    )  # fmt: skip
    try:
        child.expect_exact(PROMPT)
        started = [p.pid for p in psutil.Process(child.pid).children(recursive=True)]
        child.sendline("t5 t6 t7")
        child.expect_exact(PROMPT)
        answer = child.before.split("\n", 1)[1].strip()  # the line after the echoed input
        child.sendline("/exit")
        child.expect(pexpect.EOF, timeout=30)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before
    return answer, started


@pytest.mark.slow  # the shell's TP wiring is tests/unit/tp/test_offline.py's, through the shell
def test_shell_with_tensor_parallelism(tiny_model: Path) -> None:
    """--tp-size 2: the shell is rank 0 of an offline TP run; same answer, no rank left over."""
    from tests.e2e.server_utils import pid_alive, wait_until

    single, _ = _tiny_shell_answer(tiny_model, 1)
    answer, started = _tiny_shell_answer(tiny_model, 2)
    assert answer == single and answer.startswith("t"), (answer, single)
    assert started, "the shell started no TP rank"
    assert wait_until(lambda: not any(pid_alive(p) for p in started), 15), started
