"""Clients that go away mid-request: their requests are aborted in the scheduler and every KV
page comes back (checked through the debug route). Uses the tiny random model for speed."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from tests.e2e.server_utils import ServerHandle, wait_idle_and_check

LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0.8}


async def _cut_stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], keep: int
) -> int:
    """Read ``keep`` SSE events, then drop the connection. Returns the events seen."""
    seen = 0
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                json.loads(line[len(b"data: ") :])
                seen += 1
                if seen >= keep:
                    break
    return seen


def _metric(server: ServerHandle, name: str) -> float:
    _, text = server.get("/metrics")
    return sum(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


def test_twenty_streams_cut_mid_stream(tiny_server: ServerHandle) -> None:
    aborts_before = _metric(tiny_server, "minisgl_client_aborts_total")

    async def run() -> list[int]:
        async with aiohttp.ClientSession() as session:
            jobs = []
            for i in range(20):
                if i % 2:
                    url = tiny_server.url("/v1/chat/completions")
                    body = {
                        "messages": [{"role": "user", "content": f"t{i + 10} t9"}],
                        "stream": True,
                        **LONG,
                    }
                else:
                    url = tiny_server.url("/v1/completions")
                    body = {"prompt": f"t5 t6 t{i + 10}", "stream": True, "n": 2, **LONG}
                jobs.append(_cut_stream(session, url, body, keep=3 + i % 4))
            return await asyncio.gather(*jobs)

    seen = asyncio.run(run())
    assert all(s >= 3 for s in seen)
    body = wait_idle_and_check(tiny_server)
    assert body["total_pages"] > 0
    # 10 single streams + 10 streams of n=2 were cut before finishing.
    assert _metric(tiny_server, "minisgl_client_aborts_total") - aborts_before == 30


def test_non_stream_client_timeout_aborts(tiny_server: ServerHandle) -> None:
    async def run() -> None:
        timeout = aiohttp.ClientTimeout(total=0.5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            jobs = [
                session.post(tiny_server.url("/generate"), json={
                    "text": f"t{i} t7", "sampling_params": {"max_new_tokens": 450, "ignore_eos": True},
                })
                for i in range(5)
            ]  # fmt: skip
            results = await asyncio.gather(*jobs, return_exceptions=True)
            assert all(isinstance(r, asyncio.TimeoutError) for r in results), results

    asyncio.run(run())
    wait_idle_and_check(tiny_server)


def test_concurrent_outputs_match_sequential(tiny_server: ServerHandle) -> None:
    """Batching many requests together must not mix up or change anyone's tokens."""
    prompts = [f"t{3 + i} t{40 + i} t{90 + 2 * i}" for i in range(8)]
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    alone = [
        tiny_server.post("/generate", {"text": p, "sampling_params": params})[1] for p in prompts
    ]

    async def together() -> list[Any]:
        async with aiohttp.ClientSession() as session:

            async def one(p: str) -> Any:
                body = {"text": p, "sampling_params": params}
                async with session.post(tiny_server.url("/generate"), json=body) as r:
                    return await r.json()

            return await asyncio.gather(*(one(p) for p in prompts))

    batched = asyncio.run(together())
    assert [b["output_ids"] for b in batched] == [a["output_ids"] for a in alone]
    wait_idle_and_check(tiny_server)


def test_abort_request_route(tiny_server: ServerHandle) -> None:
    """SGLang's /abort_request: by rid (a /generate rid, an OpenAI response id) and abort_all.
    Aborted requests finish with finish_reason abort (HTTP 200, what they had so far), and
    every page comes back."""
    long_gen = {"max_new_tokens": 450, "ignore_eos": True}
    before = _metric(tiny_server, 'minisgl_server_aborts_total{reason="abort_request"}')

    async def first_event(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
        resp = await session.post(url, json=body)
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: "):
                return resp, json.loads(line[len(b"data: ") :])
        raise AssertionError("no event")

    async def rest(resp: aiohttp.ClientResponse) -> list[Any]:
        events = []
        async for line in resp.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                events.append(json.loads(line[len(b"data: ") :]))
        return events

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            gen = tiny_server.url("/generate")
            # One stream aborted by its own rid; the other keeps going until abort_all.
            a, _ = await first_event(
                session, gen, {"text": "t5 t6", "rid": "mine", "stream": True, "sampling_params": long_gen}
            )  # fmt: skip
            b, first_b = await first_event(
                session, gen, {"text": "t7 t8", "stream": True, "sampling_params": long_gen}
            )  # fmt: skip
            chat, first_c = await first_event(session, tiny_server.url("/v1/chat/completions"), {
                "messages": [{"role": "user", "content": "t9"}], "stream": True, **LONG,
            })  # fmt: skip
            ok, body = tiny_server.post("/abort_request", {"rid": "mine"})
            assert ok == 200 and body["aborted"] == 1, body
            events_a = await rest(a)
            assert events_a[-1]["meta_info"]["finish_reason"]["type"] == "abort"
            assert 0 < len(events_a[-1]["output_ids"]) < 450
            ok, body = tiny_server.post("/abort_request", {"rid": first_c["id"]})
            assert ok == 200 and body["aborted"] == 1, body
            assert (await rest(chat))[-1]["choices"][0]["finish_reason"] == "abort"
            ok, body = tiny_server.post("/abort_request", {"abort_all": True})
            assert ok == 200 and body["aborted"] == 1, body
            assert (await rest(b))[-1]["meta_info"]["finish_reason"]["type"] == "abort"
            assert first_b["meta_info"]["id"] != "mine"

    asyncio.run(run())
    status, body = tiny_server.post("/abort_request", {"rid": "no-such-request"})
    assert status == 200 and body["aborted"] == 0
    status, body = tiny_server.post("/abort_request", {})
    assert status == 400 and body["error"]["param"] == "rid"
    wait_idle_and_check(tiny_server)
    after = _metric(tiny_server, 'minisgl_server_aborts_total{reason="abort_request"}')
    assert after - before == 3
