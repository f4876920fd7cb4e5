"""The API server's own cost of taking in a request, in process (no HTTP parsing, no
engine): N streaming /v1/completions of a 2,100-id prompt go through the ASGI app until
each has been handed to IPC and waits for its first output.

    python benchmark/online/ingest_cost.py [--requests 300] [--profile 25]

Prints microseconds per request; --profile prints cProfile's top functions by own time.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import random
import sys
import tempfile
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import zmq  # noqa: E402

from minisgl.ipc import sockets  # noqa: E402
from minisgl.server.app import create_app  # noqa: E402
from minisgl.server.frontend import Frontend  # noqa: E402
from minisgl.server.observers import make_observers  # noqa: E402
from minisgl.server.state import ModelInfo, ServerState  # noqa: E402


def request_body(prompt_len: int) -> bytes:
    rng = random.Random(0)
    ids = [rng.randrange(4096) for _ in range(prompt_len)]
    return json.dumps(
        {"model": "m", "prompt": ids, "max_tokens": 64, "temperature": 0, "ignore_eos": True,
         "stream": True, "stream_options": {"include_usage": True}}
    ).encode()  # fmt: skip


async def ingest(n: int, body: bytes) -> float:
    """Seconds until ``n`` requests have all been submitted."""
    addrs = sockets.IpcAddresses.in_dir(Path(tempfile.mkdtemp()))
    ctx = zmq.Context()
    worker = sockets.bind_pull(ctx, addrs.worker)  # stands in for the tokenizer worker
    frontend = Frontend(addrs, make_observers())  # the metrics extension's, if loaded
    app = create_app(ServerState(ModelInfo("m", "/m", 4096), frontend, 0))
    await frontend.start()
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": "POST", "scheme": "http", "path": "/v1/completions",
        "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
        "headers": [(b"host", b"x"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {},
    }  # fmt: skip

    async def one() -> None:
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(3600)  # the client stays connected
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            pass

        await app(dict(scope), receive, send)

    t0 = time.perf_counter()
    tasks = [asyncio.ensure_future(one()) for _ in range(n)]
    got = 0
    while got < n:
        await asyncio.sleep(0)
        while True:
            try:
                worker.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            got += 1
    elapsed = time.perf_counter() - t0
    for t in tasks:
        t.cancel()
    await frontend.stop()
    worker.close()
    ctx.term()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--prompt-len", type=int, default=2100)
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    args = ap.parse_args()
    body = request_body(args.prompt_len)
    if args.profile:
        prof = cProfile.Profile()
        elapsed = prof.runcall(asyncio.run, ingest(args.requests, body))
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    else:
        elapsed = asyncio.run(ingest(args.requests, body))
    per = elapsed / args.requests * 1e6
    print(json.dumps({"bench": "ingest_cost", "requests": args.requests,
                      "prompt_len": args.prompt_len, "us_per_request": round(per, 1),
                      "profiled": bool(args.profile)}))  # fmt: skip


if __name__ == "__main__":
    main()
