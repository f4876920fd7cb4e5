"""Send a workload on its schedule and measure it: one call of `run_rate` is one run (one
request rate), bracketed by two /metrics scrapes so the server's figures cover just this run."""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from benchmark.online import server_metrics
from benchmark.online.backends import Endpoint, encode_payload, flush_cache, send_request
from benchmark.online.datasets import BenchRequest, arrival_times, random_ids
from benchmark.online.metrics import RequestRecord, summarize

# No overall limit: a slow server under a high rate can legitimately take minutes per request.
SESSION_TIMEOUT = aiohttp.ClientTimeout(total=6 * 3600)


def open_session() -> aiohttp.ClientSession:
    # limit=0: no client-side cap on connections, or the client itself would queue requests
    # and bias TTFT; read_bufsize: /generate events repeat all output ids so far.
    return aiohttp.ClientSession(
        timeout=SESSION_TIMEOUT,
        connector=aiohttp.TCPConnector(limit=0),
        read_bufsize=1 << 20,
    )


async def warmup(session: aiohttp.ClientSession, ep: Endpoint, n: int, vocab: int) -> None:
    """Short requests before measuring (first-call costs, connection setup). Their prompts
    come from another seed, so they do not warm the prefix cache for the workload."""
    rng = random.Random("warmup")
    for _ in range(n):
        rec = await send_request(session, ep, BenchRequest(random_ids(rng, 16, vocab), 4))
        if not rec.success:
            raise RuntimeError(f"warm-up request failed ({ep.url}): {rec.error}")


async def send_all(
    session: aiohttp.ClientSession,
    ep: Endpoint,
    requests: Sequence[BenchRequest],
    offsets: Sequence[float],
    max_concurrency: int | None,
    tag: str = "",
) -> tuple[list[RequestRecord], float]:
    """Send request i at ``offsets[i]`` seconds after the start (after waiting for a slot
    when ``max_concurrency`` is set: TTFT counts from the actual send, as in SGLang)."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    done = 0
    step = max(1, len(requests) // 10)

    # Bodies are encoded before the clock starts: a burst of 512 requests of 2,100 ids each
    # would otherwise spend ~0.2 s of the client's one thread in json.dumps between sends,
    # and count it in the TTFT of every later request (the server's latency is measured).
    bodies = {id(req): encode_payload(ep, req) for req in requests}

    async def one(req: BenchRequest) -> RequestRecord:
        nonlocal done
        if sem is None:
            rec = await send_request(session, ep, req, bodies[id(req)])
        else:
            async with sem:
                rec = await send_request(session, ep, req, bodies[id(req)])
        done += 1
        if done % step == 0 or done == len(requests):
            print(f"  {tag}{done}/{len(requests)} done", file=sys.stderr, flush=True)
        return rec

    start = time.perf_counter()
    tasks = []
    for req, offset in zip(requests, offsets, strict=True):
        wait = start + offset - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one(req)))
    records = await asyncio.gather(*tasks)
    return list(records), time.perf_counter() - start


async def run_rate(
    session: aiohttp.ClientSession,
    ep: Endpoint,
    requests: Sequence[BenchRequest],
    rate: float,
    max_concurrency: int | None = None,
    seed: int = 0,
    burstiness: float = 1.0,
    flush: bool = False,
) -> dict[str, Any]:
    """One run at ``rate`` req/s (trace requests keep their own arrival times)."""
    if flush and not await flush_cache(session, ep.base_url):
        print("  (no /flush_cache on this server; the prefix cache stays)", file=sys.stderr)
    if all(r.arrival is not None for r in requests):
        offsets, schedule = [float(r.arrival or 0.0) for r in requests], "trace timestamps"
    else:
        offsets = arrival_times(len(requests), rate, seed, burstiness)
        schedule = f"{rate:g} req/s" if rate != float("inf") else "all at once"
    before = await server_metrics.scrape(session, ep.base_url)
    # Other work on the machine skews latencies; keep the load beside the figures.
    load_before = os.getloadavg()[0]
    records, duration = await send_all(
        session, ep, requests, offsets, max_concurrency, tag=f"[{schedule}] "
    )
    after = await server_metrics.scrape(session, ep.base_url)
    summary = summarize(records, duration)
    server = None
    if before is not None and after is not None:
        server = server_metrics.server_view(server_metrics.delta(before, after))
    errors = sorted({r.error for r in records if r.error})
    return {
        "request_rate": rate,
        "schedule": schedule,
        "max_concurrency": max_concurrency,
        "summary": summary,
        "client": server_metrics.client_view(summary),
        "server": server,
        "errors": errors[:10],
        "loadavg_1m": [load_before, os.getloadavg()[0]],
        "requests": [r.to_json() for r in records],
    }
