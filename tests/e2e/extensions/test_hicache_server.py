"""A server with HiCache and a device pool too small for its prompts: a prompt evicted from
the device comes back from the host (host_cached_tokens in /generate's meta_info and in
OpenAI usage, the hicache figures in /metrics), /flush_cache empties both tiers, and the
integrity check (both tiers) passes."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.server_utils import (
    ServerHandle,
    assert_clean_log,
    metric,
    start_server,
    wait_idle_and_check,
)

PROMPTS = [list(range(10 + i, 90 + i)) for i in (0, 100, 150)]  # 80 tokens each


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[ServerHandle]:
    handle = start_server(
        ["--model", str(tiny_model), "--num-pages", "120", "--hicache-size", "0.01"]
    )
    yield handle
    assert handle.stop(signal.SIGTERM) == 0, handle.log()[-3000:]
    assert_clean_log(handle)


def _generate(server: ServerHandle, ids: list[int]) -> dict[str, object]:
    params = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
    status, out = server.post("/generate", {"input_ids": ids, "sampling_params": params})
    assert status == 200, out
    meta = out["meta_info"]
    assert isinstance(meta, dict)
    return meta


def test_host_hits_reported_and_flushed(server: ServerHandle) -> None:
    for ids in PROMPTS:  # the third evicts the first from the 120-page device pool
        assert "host_cached_tokens" not in _generate(server, ids)
    meta = _generate(server, PROMPTS[0] + [7])
    assert meta["host_cached_tokens"] == meta["cached_tokens"] == 80, meta
    body = {"prompt": PROMPTS[1] + [8], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    status, comp = server.post("/v1/completions", body)
    assert status == 200, comp
    assert comp["usage"]["host_cached_tokens"] > 0, comp["usage"]
    assert metric(server, "minisgl_hicache_loaded_tokens_total") >= 80
    assert metric(server, "minisgl_hicache_bytes_to_host_total") > 0
    used = metric(server, "minisgl_hicache_host_pages_used")
    assert 0 < used <= metric(server, "minisgl_hicache_host_pages")
    wait_idle_and_check(server)
    status, flushed = server.post("/flush_cache")
    assert status == 200, flushed
    assert metric(server, "minisgl_hicache_host_pages_used") == 0
    assert _generate(server, PROMPTS[0] + [7])["cached_tokens"] == 0
    wait_idle_and_check(server)
