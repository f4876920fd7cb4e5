"""A replica of ``--dp-size 2`` killed (SIGKILL) in the middle of 50 requests: every request
in flight ends (answered, or a clean HTTP error: none hangs), the launcher logs the death and
takes the replica out of the router, requests sent afterwards all succeed, and SIGTERM of the
launcher lets a stream in flight finish and leaves no process behind."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from tests.e2e.server_utils import (
    QUESTION,
    pid_alive,
    process_tree,
    replica_pids,
    start_dp_server,
    wait_until,
)

pytest.importorskip("sglang_router")
pytestmark = pytest.mark.slow

KEY = "dp-fault-key"
ASK: Any = QUESTION
LONG: dict[str, Any] = {"max_tokens": 48, "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_replica_killed_mid_run() -> None:
    # Round robin: both replicas serve, so the one killed has requests in flight.
    server = start_dp_server(
        ["--served-model-name", "m", "--router-policy", "round_robin"], replicas=2, key=KEY
    )
    pids = process_tree(server.proc.pid)
    client = openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0, timeout=120)

    def ask(i: int) -> str:
        """Every other request streams: a stream cut by the kill cannot be retried."""
        started = time.monotonic()
        try:
            if i % 2:
                chunks = client.chat.completions.create(
                    model="m", messages=ASK, stream=True, **LONG
                )
                ends = [c.choices[0].finish_reason for c in chunks if c.choices]
                return "ok" if ends[-1] == "length" else f"ended {ends[-1]}"
            client.chat.completions.create(model="m", messages=ASK, **LONG)
            return "ok"
        except openai.APIStatusError as exc:  # a clean error: an HTTP status and a body
            return f"error {exc.status_code}"
        except openai.APITimeoutError:
            return f"hung {time.monotonic() - started:.0f}s"
        except openai.APIConnectionError:  # the stream was cut: the client knows at once
            return "cut"

    try:
        with ThreadPoolExecutor(10) as pool:
            futures = [pool.submit(ask, i) for i in range(50)]
            while sum(f.done() for f in futures) < 10:
                time.sleep(0.1)
            os.kill(replica_pids(server)[0], signal.SIGKILL)
            outcomes = [f.result() for f in futures]
        assert not [o for o in outcomes if o.startswith("hung")], outcomes
        assert all(o in ("ok", "cut") or re.fullmatch(r"error 5\d\d", o) for o in outcomes), (
            outcomes
        )
        assert wait_until(lambda: "replica 0" in server.log() and "removed" in server.log(), 30)
        assert re.search(r"replica 0 \(.*\) exited with code -9", server.log()), server.log()
        after = [client.chat.completions.create(model="m", messages=ASK, max_tokens=4)]
        after += [client.completions.create(model="m", prompt="Hi", max_tokens=4) for _ in range(9)]
        assert all(a.choices for a in after)
        # SIGTERM with a stream in flight: the router lets it finish, then all stops.
        started, ends = threading.Event(), list[str]()

        def stream() -> None:
            chunks = client.chat.completions.create(model="m", messages=ASK, stream=True, **LONG)
            for chunk in chunks:
                started.set()
                ends.extend(c.finish_reason for c in chunk.choices if c.finish_reason)

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        reader.join(120)
        assert ends == ["length"], ends
    finally:
        code = server.stop(signal.SIGTERM)
    assert code == 0, server.log()[-3000:]
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), 10), server.log()[-3000:]
    server.log_path.unlink(missing_ok=True)
