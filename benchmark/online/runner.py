"""Send a workload on its schedule and measure it: one call of `run_rate` is one run (one
request rate), bracketed by two /metrics scrapes so the server's figures cover just this run."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import queue
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from benchmark.online import server_metrics
from benchmark.online.backends import Endpoint, encode_payload, flush_cache, send_request
from benchmark.online.datasets import BenchRequest, Renderer, arrival_times, random_ids
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
    processes: int = 1,
) -> tuple[list[RequestRecord], float]:
    """Send request i at ``offsets[i]`` seconds after the start (after waiting for a slot
    when ``max_concurrency`` is set: TTFT counts from the actual send, as in SGLang).
    ``processes`` > 1: the requests are dealt round-robin to that many client processes,
    each with its own event loop, on one shared schedule (see `_send_in_processes`)."""
    # Bodies are encoded before the clock starts: a burst of 512 requests of 2,100 ids each
    # would otherwise spend ~0.2 s of the client's one thread in json.dumps between sends,
    # and count it in the TTFT of every later request (the server's latency is measured).
    bodies = [encode_payload(ep, req) for req in requests]
    if processes > 1:
        return await asyncio.get_running_loop().run_in_executor(
            None, _send_in_processes, ep, requests, bodies, offsets, processes
        )
    start = time.perf_counter()
    records = await _send_scheduled(
        session, ep, requests, bodies, offsets, start, max_concurrency, tag
    )
    return records, time.perf_counter() - start


async def _send_scheduled(
    session: aiohttp.ClientSession,
    ep: Endpoint,
    requests: Sequence[BenchRequest],
    bodies: Sequence[bytes],
    offsets: Sequence[float],
    start: float,
    max_concurrency: int | None,
    tag: str,
) -> list[RequestRecord]:
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    done = 0
    step = max(1, len(requests) // 10)

    async def one(req: BenchRequest, body: bytes) -> RequestRecord:
        nonlocal done
        if sem is None:
            rec = await send_request(session, ep, req, body)
        else:
            async with sem:
                rec = await send_request(session, ep, req, body)
        done += 1
        if tag and (done % step == 0 or done == len(requests)):
            print(f"  {tag}{done}/{len(requests)} done", file=sys.stderr, flush=True)
        return rec

    tasks = []
    for req, body, offset in zip(requests, bodies, offsets, strict=True):
        wait = start + offset - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one(req, body)))
    return list(await asyncio.gather(*tasks))


def _send_in_processes(
    ep: Endpoint,
    requests: Sequence[BenchRequest],
    bodies: Sequence[bytes],
    offsets: Sequence[float],
    processes: int,
) -> tuple[list[RequestRecord], float]:
    """One client event loop spends tens of microseconds on every SSE event it reads: under
    a burst of hundreds of streams it falls behind, and its own backlog shows up as server
    latency. Here worker p sends requests p, p + N, ... All start together once every worker
    is ready, at one start time on the shared monotonic clock (perf_counter is system-wide
    on Linux), so the records of every worker are comparable."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    plain = dataclasses.replace(ep, renderer=Renderer())  # bodies are encoded: no tokenizer
    ready, results = ctx.Queue(), ctx.Queue()
    starts = [ctx.Queue() for _ in range(processes)]
    workers = []
    for p in range(processes):
        share = range(p, len(requests), processes)
        args = (plain, [requests[i] for i in share], [bodies[i] for i in share],
                [offsets[i] for i in share], p, ready, starts[p], results)  # fmt: skip
        workers.append(ctx.Process(target=_client_worker, args=args, daemon=True))
        workers[-1].start()
    try:
        for _ in workers:
            ready.get(timeout=120)
        start = time.perf_counter() + 0.05
        for q in starts:
            q.put(start)
        records: list[RequestRecord] = [RequestRecord()] * len(requests)
        pending = set(range(processes))
        while pending:
            try:
                p, recs = results.get(timeout=1.0)
            except queue.Empty:
                dead = [q for q in pending if not workers[q].is_alive()]
                if dead:
                    raise RuntimeError(f"client process {dead[0]} died") from None
                continue
            pending.discard(p)
            for i, rec in zip(range(p, len(requests), processes), recs, strict=True):
                records[i] = rec
    finally:
        for w in workers:
            w.join(10)
            if w.is_alive():
                w.kill()
    return records, max((r.end for r in records), default=start) - start


def _client_worker(
    ep: Endpoint,
    requests: list[BenchRequest],
    bodies: list[bytes],
    offsets: list[float],
    index: int,
    ready: Any,
    start_queue: Any,
    results: Any,
) -> None:
    async def run() -> list[RequestRecord]:
        async with open_session() as session:
            ready.put(index)
            start = start_queue.get()
            return await _send_scheduled(session, ep, requests, bodies, offsets, start, None, "")

    results.put((index, asyncio.run(run())))


async def run_rate(
    session: aiohttp.ClientSession,
    ep: Endpoint,
    requests: Sequence[BenchRequest],
    rate: float,
    max_concurrency: int | None = None,
    seed: int = 0,
    burstiness: float = 1.0,
    flush: bool = False,
    processes: int = 1,
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
        session, ep, requests, offsets, max_concurrency, f"[{schedule}] ", processes
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
