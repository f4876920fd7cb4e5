"""The scheduler-process loop over real ZMQ sockets with a real (tiny) engine, run in a thread
of the test process so that a failure can be injected into one step."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from minisgl.config import EngineConfig
from minisgl.ipc import sockets
from minisgl.ipc.messages import AbortRequests
from minisgl.server.scheduler_process import SchedulerArgs, SchedulerLoop
from tests.e2e.scheduler_harness import Harness


@pytest.fixture
def harness(tiny_model: Path, tmp_path: Path) -> Iterator[Harness]:
    from minisgl.engine.engine import Engine

    config = EngineConfig(model=str(tiny_model))
    addresses = sockets.IpcAddresses.in_dir(tmp_path)
    args = SchedulerArgs(config, addresses, str(tmp_path / "tokenizer"), os.getppid())
    loop = SchedulerLoop(Engine(config), args)
    h = Harness(loop, addresses)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    yield h
    loop.stop()
    thread.join(10)
    h.ctx.destroy(linger=0)


def test_outputs_are_incremental_and_complete(harness: Harness) -> None:
    harness.add((1, [5, 6, 7], {"max_tokens": 5, "temperature": 0}), (2, [9], {"max_tokens": 3}))
    harness.pump(lambda: harness.finished(1) and harness.finished(2))
    for rid, n in ((1, 5), (2, 3)):
        outs = harness.outputs[rid]
        assert sum(len(o.new_ids) for o in outs) == n == outs[-1].completion_tokens
        assert [o.finish_reason for o in outs][-1] == "length"
        assert all(o.finish_reason is None for o in outs[:-1])


def test_group_is_validated_all_or_none(harness: Harness) -> None:
    harness.add((1, [5, 6], {"max_tokens": 3}), (2, [], {"max_tokens": 3}))
    harness.pump(lambda: harness.finished(1) and harness.finished(2))
    for rid in (1, 2):
        (out,) = harness.outputs[rid]
        assert out.error and out.error_status == 400 and not out.new_ids
    assert harness.control("integrity").data["live_requests"] == 0


def test_abort_reports_and_frees(harness: Harness) -> None:
    harness.add((1, [5, 6], {"max_tokens": 400, "ignore_eos": True}))
    harness.pump(lambda: len(harness.outputs.get(1, [])) >= 2)
    sockets.send(harness.to_scheduler, AbortRequests([1]))
    harness.pump(lambda: harness.finished(1))
    assert harness.outputs[1][-1].finish_reason == "abort"
    reply = harness.control("integrity")
    assert reply.ok and reply.data["running"] == 0 and reply.data["live_requests"] == 0


def test_a_failing_step_aborts_its_requests_and_the_loop_goes_on(harness: Harness) -> None:
    scheduler = harness.loop.scheduler
    real_step = scheduler.step
    calls = {"n": 0}

    def flaky_step() -> list[Any]:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return real_step()

    scheduler.step = flaky_step  # type: ignore[method-assign]
    harness.add((1, [5, 6], {"max_tokens": 50, "ignore_eos": True}))
    harness.pump(lambda: harness.finished(1))
    last = harness.outputs[1][-1]
    assert last.error_status == 500 and "injected failure" in (last.error or "")
    # The next request is served normally, and nothing leaked.
    harness.add((2, [7, 8], {"max_tokens": 4}))
    harness.pump(lambda: harness.finished(2))
    assert harness.outputs[2][-1].finish_reason == "length" and not harness.outputs[2][-1].error
    reply = harness.control("integrity")
    assert reply.ok and reply.data["running"] == 0 and reply.data["live_requests"] == 0
