"""The interactive shell, driven through a pseudo-terminal with the default model."""

from __future__ import annotations

import os
import sys

import pexpect

from tests.e2e.server_utils import REPO

PROMPT = ">>> "


def test_shell_answers_and_resets() -> None:
    env = {
        **os.environ,
        "MINISGL_SHELL_TEMPERATURE": "0",  # greedy: the same question gets the same answer
        "MINISGL_SHELL_MAX_TOKENS": "16",
        "PROMPT_TOOLKIT_NO_CPR": "1",  # pexpect does not answer cursor-position requests
        "TERM": "dumb",
    }
    child = pexpect.spawn(
        sys.executable, ["-m", "minisgl", "--shell"], cwd=str(REPO), env=env,
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
