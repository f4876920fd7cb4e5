"""Server protection, end to end on the tiny random model: the API key, the queue limit
(503 + Retry-After), the request timeout, the body size limit, graceful SIGTERM under load,
and the scheduler's idle leak guard."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from minisgl import env
from tests.e2e.server_utils import (
    ServerHandle,
    assert_clean_log,
    call,
    check_idle,
    metric,
    pid_alive,
    request,
    start_server,
    stop_and_check,
    wait_until,
)

KEY = "sk-reliability-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}


# ---------------------------------------------------------------- helpers
def error_of(body: Any, status: int) -> str:
    """The message of an OpenAI-style error body (asserting the shape)."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert err["code"] == status and isinstance(err["type"], str) and "param" in err, body
    return str(err["message"])


async def read_sse(resp: aiohttp.ClientResponse) -> list[Any]:
    """Events of an SSE response ("[DONE]" included), parsed as JSON where they are JSON."""
    events: list[Any] = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            payload = line[len(b"data: ") :].strip().decode()
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# ---------------------------------------------------------------- API key + overload
@pytest.fixture(scope="module")
def guarded(tiny_model: Path) -> Iterator[ServerHandle]:
    """API key from the environment, 2 running + at most 2 queued, a 64 KiB body limit."""
    server = start_server(
        [
            "--model", str(tiny_model), "--served-model-name", "tiny",
            "--max-running-requests", "2", "--max-queued-requests", "2",
            "--max-request-bytes", "65536",
        ],
        switches={env.API_KEY: KEY},
    )  # fmt: skip
    yield server
    stop_and_check(server, secret=KEY)


def _routes(server: ServerHandle) -> list[tuple[str, str]]:
    status, schema = call(server, "GET", "/openapi.json", headers=AUTH)
    assert status == 200, schema
    routes = [
        (method.upper(), path.replace("{model_id}", "tiny"))
        for path, ops in schema["paths"].items()
        for method in ops
    ]
    return [*routes, ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/no/such/route")]


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-key"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": KEY},
        {"Authorization": f"Bearer {KEY}x"},
    ],
    ids=["missing", "wrong", "basic", "no-scheme", "longer"],
)
def test_every_route_but_health_needs_the_key(guarded: ServerHandle, headers: dict) -> None:
    routes = _routes(guarded)
    assert len(routes) >= 13
    for method, path in routes:
        body = {} if method == "POST" else None
        reply = request(guarded, method, path, body, headers=headers)
        if path in ("/health", "/health_generate"):  # open, as in SGLang
            assert reply.status == 200, reply
            continue
        assert reply.status == 401, (method, path, reply)
        assert "API key" in error_of(reply.body, 401)
        assert reply.headers.get("www-authenticate", reply.headers.get("WWW-Authenticate"))
    assert metric(guarded, 'minisgl_rejected_requests_total{reason="unauthorized"}', AUTH) > 0


def test_the_key_opens_every_route(guarded: ServerHandle) -> None:
    for method, path in _routes(guarded):
        body = {} if method == "POST" else None
        reply = request(guarded, method, path, body, headers={"Authorization": f"bearer {KEY}"})
        expected = 404 if path == "/no/such/route" else 400 if method == "POST" and path in (
            "/v1/chat/completions", "/v1/completions", "/v1/responses", "/generate",
            "/abort_request",
        ) else 200  # fmt: skip
        assert reply.status == expected, (method, path, reply)


def test_openai_client_with_the_key(guarded: ServerHandle) -> None:
    client = openai.OpenAI(base_url=guarded.url("/v1"), api_key=KEY, max_retries=0, timeout=120)
    assert [m.id for m in client.models.list()] == ["tiny"]
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "t7 t8"}], max_tokens=4,
        temperature=0,
    )  # fmt: skip
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage
    chunks = list(
        client.completions.create(
            model="tiny", prompt="t5 t6", max_tokens=4, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    bad = openai.OpenAI(base_url=guarded.url("/v1"), api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_over_the_queue_limit_503_and_accepted_requests_complete(guarded: ServerHandle) -> None:
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    prompts = [f"t{5 + i} t{60 + i}" for i in range(10)]

    async def burst() -> list[tuple[int, str | None, Any]]:
        async with aiohttp.ClientSession(headers=AUTH) as session:

            async def one(prompt: str) -> tuple[int, str | None, Any]:
                body = {"text": prompt, "sampling_params": params}
                async with session.post(guarded.url("/generate"), json=body) as r:
                    return r.status, r.headers.get("Retry-After"), await r.json()

            return await asyncio.gather(*(one(p) for p in prompts))

    rejected_before = metric(guarded, 'minisgl_rejected_requests_total{reason="queue_full"}', AUTH)
    results = asyncio.run(burst())
    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 503}, results
    assert statuses.count(200) >= 2 and statuses.count(503) >= 1, statuses
    for prompt, (status, retry_after, body) in zip(prompts, results, strict=True):
        if status == 503:
            assert retry_after is not None and int(retry_after) >= 1
            assert "overloaded" in error_of(body, 503)
            continue
        # Every accepted request is answered in full, with the tokens it gets when alone.
        assert body["meta_info"]["finish_reason"]["type"] == "length", body
        alone = request(guarded, "POST", "/generate", {"text": prompt, "sampling_params": params},
                        headers=AUTH)  # fmt: skip
        assert alone.status == 200 and alone.body["output_ids"] == body["output_ids"]
    rejected = metric(guarded, 'minisgl_rejected_requests_total{reason="queue_full"}', AUTH)
    assert rejected - rejected_before == statuses.count(503)
    check_idle(guarded, AUTH)


def _post_chunked(server: ServerHandle, path: str, chunks: list[bytes]) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request(
            "POST", path, body=iter(chunks), encode_chunked=True,
            headers={**AUTH, "Content-Type": "application/json", "Transfer-Encoding": "chunked"},
        )  # fmt: skip
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_body_size_limit(guarded: ServerHandle) -> None:
    name = 'minisgl_rejected_requests_total{reason="body_too_large"}'
    refused_before = metric(guarded, name, AUTH)
    big = {"text": "t5 " * 30_000, "sampling_params": {"max_new_tokens": 1}}  # ~90 KB
    status, body = call(guarded, "POST", "/generate", big, headers=AUTH)
    assert status == 413 and "--max-request-bytes" in error_of(body, 413)
    # Chunked upload (no Content-Length): refused once the limit is crossed.
    status, body = _post_chunked(guarded, "/v1/completions", [b"x" * 16384] * 6)
    assert status == 413, body
    # Under the limit, chunked or not, the body reaches the route.
    small = json.dumps({"prompt": "t5 t6", "max_tokens": 2}).encode()
    status, body = _post_chunked(guarded, "/v1/completions", [small[:10], small[10:]])
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body
    assert metric(guarded, name, AUTH) - refused_before == 2


# ---------------------------------------------------------------- request timeout
@pytest.fixture(scope="module")
def timeout_server(tiny_long_model: Path) -> Iterator[ServerHandle]:
    server = start_server(["--model", str(tiny_long_model), "--request-timeout", "2"])
    # First uses are slow (lazy initialisation, the chat template's compilation): warm every
    # route up so that the limit only ever hits the long requests.
    for _ in range(2):
        call(server, "POST", "/v1/completions", {"prompt": "t5", "max_tokens": 2})
        chat = {"messages": [{"role": "user", "content": "t9"}], "max_tokens": 2}
        call(server, "POST", "/v1/chat/completions", chat)
        call(server, "POST", "/generate", {"text": "t5", "sampling_params": {"max_new_tokens": 2}})
    yield server
    stop_and_check(server)


def test_request_timeout_aborts_and_frees(timeout_server: ServerHandle) -> None:
    # 8,000 tokens take far more than two seconds (a step takes a millisecond or more).
    long = {"max_tokens": 8000, "ignore_eos": True}

    async def run() -> tuple[list[Any], tuple[int, Any]]:
        async with aiohttp.ClientSession() as session:
            chat = {"messages": [{"role": "user", "content": "t9"}], "stream": True, "n": 2, **long}
            async with session.post(timeout_server.url("/v1/chat/completions"), json=chat) as r:
                assert r.status == 200
                events = await read_sse(r)
            body = {"text": "t5", "sampling_params": {"max_new_tokens": 8000, "ignore_eos": True}}
            async with session.post(timeout_server.url("/generate"), json=body) as r:
                return events, (r.status, await r.json())

    started = time.monotonic()
    events, (status, body) = asyncio.run(run())
    assert time.monotonic() - started < 30
    # The stream: content, then finish_reason "abort" for each open choice, then the error.
    assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
    assert "request timeout" in error_of(events[-2], 504)
    finishes = [c for e in events[:-2] for c in e["choices"] if c["finish_reason"]]
    assert sorted((c["index"], c["finish_reason"]) for c in finishes) == [
        (0, "abort"),
        (1, "abort"),
    ]
    assert any(c["delta"].get("content") for e in events[:-2] for c in e["choices"])
    # Non-streaming: an HTTP error.
    assert status == 504 and "request timeout" in error_of(body, 504)
    # KV freed, nothing live, and short requests are still served.
    check_idle(timeout_server)
    status, body = call(
        timeout_server, "POST", "/v1/completions", {"prompt": "t5", "max_tokens": 3}
    )
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    assert metric(timeout_server, 'minisgl_server_aborts_total{reason="timeout"}') >= 3


# ---------------------------------------------------------------- graceful SIGTERM
def test_sigterm_under_load_drains_then_stops(tiny_long_model: Path) -> None:
    """Running requests finish within --shutdown-timeout; what cannot is aborted and its
    client told so; new requests get 503 meanwhile; every process is gone afterwards."""
    server = start_server(
        ["--model", str(tiny_long_model), "--max-running-requests", "4", "--shutdown-timeout", "6"]
    )
    pids = {**server.child_pids(), "server": server.proc.pid}
    short = {"max_tokens": 24, "ignore_eos": True}
    # 24 x 4,000 tokens on 4 slots is 24,000 steps: far more than 6 s, so some get aborted.
    long = {"max_tokens": 4000, "ignore_eos": True, "stream": True}
    after: dict[str, Any] = {}

    async def stream(session: aiohttp.ClientSession, body: dict[str, Any]) -> tuple[int, Any]:
        try:
            async with session.post(server.url("/v1/completions"), json=body) as r:
                if r.status != 200 or not body.get("stream"):
                    return r.status, await r.json()
                return r.status, await read_sse(r)
        except aiohttp.ClientError as exc:  # must not happen: every client gets an answer
            return -1, repr(exc)

    async def run() -> list[tuple[int, Any]]:
        async with aiohttp.ClientSession() as session:
            shorts = [
                asyncio.create_task(stream(session, {"prompt": f"t{5 + i} t9", **short}))
                for i in range(4)
            ]
            await asyncio.sleep(0.2)  # the short ones first: they take the 4 slots
            longs = [
                asyncio.create_task(stream(session, {"prompt": f"t{20 + i}", **long}))
                for i in range(24)
            ]
            await asyncio.sleep(0.3)
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            async with session.post(server.url("/v1/completions"), json={"prompt": "t5"}) as r:
                after["status"], after["retry"] = r.status, r.headers.get("Retry-After")
                after["body"] = await r.json()
            async with session.get(server.url("/health")) as r:
                after["health"] = r.status
            return await asyncio.gather(*shorts, *longs)

    results = asyncio.run(run())
    code = server.proc.wait(30)
    assert code == 0, server.log()[-3000:]
    assert after["status"] == 503 and after["retry"] and after["health"] == 503, after
    assert "shutting down" in error_of(after["body"], 503)
    for status, body in results[:4]:  # running when SIGTERM came: they finish
        assert status == 200, body
        assert body["choices"][0]["finish_reason"] == "length", body
        assert body["usage"]["completion_tokens"] == 24, body
    aborted = 0
    for status, events in results[4:]:
        if status == 503:  # still queued at the deadline: told before any output
            assert "shutting down" in error_of(events, 503)
            aborted += 1
            continue
        assert status == 200 and events[-1] == "[DONE]", (status, events)
        last = events[-2]
        if "error" in last:  # running at the deadline: the stream says so
            assert "shutting down" in error_of(last, 503)
            assert events[-3]["choices"][0]["finish_reason"] == "abort"
            aborted += 1
        else:
            assert last["choices"][0]["finish_reason"] == "length"
    assert aborted >= 1
    assert wait_until(lambda: not any(pid_alive(p) for p in pids.values()), 10)
    assert not server.run_dir().exists()
    log = server.log()
    assert "shutting down: refusing new requests" in log
    assert "timeout graceful shutdown exceeded" not in log  # every answer went out in time
    assert_clean_log(server)


# ---------------------------------------------------------------- hung scheduler
def test_health_reports_a_hung_scheduler(tiny_model: Path) -> None:
    """A scheduler that is alive but stuck (SIGSTOP): /health and /health_generate turn 503
    within the health timeout, and back to 200 once it runs again; the probes leak no KV."""
    server = start_server(["--model", str(tiny_model), "--health-timeout", "2"])
    try:
        scheduler = server.child_pids()["scheduler-tp0"]
        assert call(server, "GET", "/health") == (200, {"status": "ok"})
        assert call(server, "GET", "/health_generate") == (200, {"status": "ok"})
        os.kill(scheduler, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            status, body = call(server, "GET", "/health_generate")
            assert status == 503 and "unhealthy" in error_of(body, 503), body
            assert time.monotonic() - stopped < 6
            # One ping interval (timeout / 4) plus the timeout, at most.
            assert wait_until(lambda: call(server, "GET", "/health")[0] == 503, 6, 0.1)
            assert time.monotonic() - stopped < 8
            status, body = call(server, "GET", "/health")
            assert "liveness ping" in error_of(body, 503), body
            status, body = call(server, "GET", "/health_generate")  # answers at once now
            assert status == 503 and "liveness ping" in error_of(body, 503), body
        finally:
            os.kill(scheduler, signal.SIGCONT)
        assert wait_until(lambda: call(server, "GET", "/health")[0] == 200, 10, 0.1)
        assert call(server, "GET", "/health_generate") == (200, {"status": "ok"})
        status, body = call(server, "POST", "/v1/completions", {"prompt": "t5", "max_tokens": 3})
        assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
        check_idle(server)  # the probes aborted while it was stopped freed their KV
        # The probes stay out of the request metrics: only the completion is counted.
        assert metric(server, "minisgl_requests_total") == 1
    finally:
        stop_and_check(server)


# ---------------------------------------------------------------- leak guard
def test_idle_leak_guard_logs_counts_and_keeps_serving(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """A page taken behind the scheduler's back is reported once the loop goes idle."""
    from minisgl.config import EngineConfig
    from minisgl.engine.engine import Engine
    from minisgl.ipc import sockets
    from minisgl.server import scheduler_control
    from minisgl.server import scheduler_process as process
    from tests.e2e.scheduler_harness import Harness

    monkeypatch.setattr(scheduler_control, "INTEGRITY_INTERVAL_S", 0.0)
    config = EngineConfig(model=str(tiny_model))
    addresses = sockets.IpcAddresses.in_dir(tmp_path)
    args = process.SchedulerArgs(config, addresses, str(tmp_path / "tok"), os.getppid())
    loop = process.SchedulerLoop(Engine(config), args)
    harness = Harness(loop, addresses)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        harness.add((1, [5, 6, 7], {"max_tokens": 4}))
        harness.pump(lambda: harness.finished(1))
        stats = harness.control("stats").data
        assert stats["integrity_violations"] == 0
        leaked = loop.scheduler.kv.allocator.alloc(1)  # while idle: the loop is polling
        assert leaked is not None
        harness.add((2, [8, 9], {"max_tokens": 4}))
        harness.pump(lambda: harness.finished(2))
        assert wait_until(lambda: harness.control("stats").data["integrity_violations"] >= 1, 10)
        assert any("KV leak detected" in r.getMessage() for r in caplog.records)
        # Still serving.
        harness.add((3, [10, 11], {"max_tokens": 3}))
        harness.pump(lambda: harness.finished(3))
        assert harness.outputs[3][-1].finish_reason == "length"
    finally:
        loop.stop()
        thread.join(10)
        harness.ctx.destroy(linger=0)
