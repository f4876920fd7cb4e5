"""Request priorities through a real server process: `priority` as an extra body field of the
OpenAI routes (official openai client) and on /generate; a higher-priority arrival preempts a
running lower-priority request; bad values are a 400 naming the field, with the server
serving on; without the policy a non-zero priority is refused (vLLM's rule)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.server_utils import ServerHandle, start_server, wait_idle_and_check

MODEL = "tiny"
LONG = 300  # tokens: the low-priority request outlasts the high-priority one by far


@pytest.fixture(scope="module")
def priority_server(tiny_long_model: Path) -> Iterator[ServerHandle]:
    server = start_server(
        ["--model", str(tiny_long_model), "--served-model-name", MODEL,
         "--schedule-policy", "priority", "--max-running-requests", "1"]
    )  # fmt: skip
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def _client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0, timeout=120)


def _bad(call: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.status_code == 400
    return dict(info.value.response.json()["error"])


def test_priority_routes_and_preemption(priority_server: ServerHandle) -> None:
    client = _client(priority_server)
    greedy: dict[str, Any] = {"temperature": 0, "max_tokens": 4}
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "t5 t6"}], **greedy,
        extra_body={"priority": -3, "ignore_eos": True},
    )  # fmt: skip
    assert chat.usage is not None and chat.usage.completion_tokens == 4
    status, body = priority_server.post(
        "/generate",
        {
            "text": "t5 t6",
            "priority": 2,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        },
    )
    assert status == 200, body

    # One request slot, held by a long low-priority stream: a high-priority request preempts it.
    low_done: dict[str, Any] = {}

    def run_low(started: threading.Event) -> None:
        stream = client.completions.create(
            model=MODEL, prompt="t7 t8 t9", temperature=0, max_tokens=LONG, stream=True,
            extra_body={"priority": 5, "ignore_eos": True},
        )  # fmt: skip
        text = []
        for chunk in stream:
            started.set()
            text.append(chunk.choices[0].text if chunk.choices else "")
            if chunk.choices and chunk.choices[0].finish_reason:
                low_done["finish_reason"] = chunk.choices[0].finish_reason
        low_done["text"], low_done["at"] = "".join(text), time.perf_counter()

    started = threading.Event()
    worker = threading.Thread(target=run_low, args=(started,))
    worker.start()
    assert started.wait(60)
    high = client.completions.create(
        model=MODEL, prompt="t3 t4", **greedy, extra_body={"priority": 0, "ignore_eos": True}
    )
    high_at = time.perf_counter()
    worker.join(300)
    assert not worker.is_alive()
    assert high.choices[0].finish_reason == "length"
    assert high_at < low_done["at"], "the high-priority request waited for the low one"
    assert low_done["finish_reason"] == "length"
    stats = wait_idle_and_check(priority_server)
    assert stats["priority_preemptions"] == 1, stats
    # Preemption changed no token: the low request alone gives the same text.
    alone = client.completions.create(
        model=MODEL, prompt="t7 t8 t9", temperature=0, max_tokens=LONG,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert alone.choices[0].text == low_done["text"]


@pytest.mark.parametrize("bad", [True, "1", 1.5, 2**63, "high"])
def test_bad_priority_is_a_400(priority_server: ServerHandle, bad: Any) -> None:
    client = _client(priority_server)
    body = _bad(
        lambda: client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "t5"}],
            max_tokens=2,
            extra_body={"priority": bad},
        )  # fmt: skip
    )
    assert body["param"] == "priority", body
    status, err = priority_server.post("/generate", {"text": "t5", "priority": bad})
    assert status == 400 and err["error"]["param"] == "priority", err
    status, err = priority_server.post(
        "/v1/completions", {"model": MODEL, "prompt": "t5", "priority": bad}
    )
    assert status == 400 and err["error"]["param"] == "priority", err
    # Nothing was queued, and the server serves on.
    out = client.completions.create(model=MODEL, prompt="t5", max_tokens=2, temperature=0)
    assert out.choices[0].text
    wait_idle_and_check(priority_server)


def test_nonzero_priority_without_the_policy(tiny_server: ServerHandle) -> None:
    """The default (fcfs) server: priority 0 is accepted, anything else refused (vLLM)."""
    client = _client(tiny_server)
    out = client.completions.create(
        model=MODEL, prompt="t5", max_tokens=2, temperature=0, extra_body={"priority": 0}
    )
    assert out.choices[0].text
    body = _bad(
        lambda: client.completions.create(
            model=MODEL, prompt="t5", max_tokens=2, extra_body={"priority": 1}
        )
    )
    assert body["param"] == "priority" and "priority scheduling" in body["message"], body
    status, err = tiny_server.post("/generate", {"text": "t5", "priority": -1})
    assert status == 400 and err["error"]["param"] == "priority", err
    wait_idle_and_check(tiny_server)
