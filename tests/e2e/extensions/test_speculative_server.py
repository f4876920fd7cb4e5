"""A server with a draft model (the tiny model drafting for itself): the speculation figures
in /generate's meta_info, in OpenAI usage and in /metrics; nothing leaks."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.server_utils import (
    ServerHandle,
    assert_clean_log,
    start_server,
    wait_idle_and_check,
)

K = 3


@pytest.fixture(scope="module")
def spec_server(tiny_model: Path) -> Iterator[ServerHandle]:
    server = start_server(
        ["--model", str(tiny_model), "--speculative-draft-model", str(tiny_model),
         "--speculative-num-steps", str(K)]
    )  # fmt: skip
    yield server
    assert server.stop(signal.SIGTERM) == 0, server.log()[-3000:]
    assert_clean_log(server)


def _metrics(server: ServerHandle) -> dict[str, float]:
    status, text = server.get("/metrics")
    assert status == 200
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_meta_info_usage_and_metrics(spec_server: ServerHandle) -> None:
    steps = 4
    body = {
        "input_ids": list(range(10, 30)),
        "sampling_params": {
            "temperature": 0, "max_new_tokens": 1 + steps * (K + 1), "ignore_eos": True
        },
    }  # fmt: skip
    status, out = spec_server.post("/generate", body)
    assert status == 200, out
    meta = out["meta_info"]
    assert meta["spec_verify_steps"] == steps
    assert meta["spec_draft_tokens"] == meta["spec_accepted_tokens"] == steps * K
    assert meta["spec_accept_length"] == K + 1
    status, comp = spec_server.post(
        "/v1/completions",
        {"prompt": list(range(40, 50)), "max_tokens": 9, "temperature": 0, "ignore_eos": True},
    )
    assert status == 200, comp
    usage = comp["usage"]
    assert usage["completion_tokens_details"] == {
        "accepted_prediction_tokens": 2 * K,
        "rejected_prediction_tokens": 0,
    }
    assert usage["spec_verify_steps"] == 2 and usage["spec_accept_length"] == K + 1
    values = _metrics(spec_server)
    assert values["minisgl_spec_verify_steps_total"] == steps + 2
    assert values["minisgl_spec_accepted_tokens_total"] == (steps + 2) * K
    assert values["minisgl_spec_draft_tokens_total"] == (steps + 2) * K
    assert values["minisgl_spec_accept_length"] == K + 1
    assert values["minisgl_spec_request_accept_length_count"] == 2
    wait_idle_and_check(spec_server)
