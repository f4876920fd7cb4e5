"""CPU decoding against llama.cpp on the same GGUF: batch 1 and 16 concurrent requests.

    bash ../shared/tools/build_llamacpp.sh      # builds llama-server, prints its path
    python benchmark/offline/bench_cpu_peer.py --llama-server /tmp/peer-llama/.../llama-server

Both servers get the same file, the same thread count (--threads, default: the physical
cores) and the same client: ``/v1/completions``, a ~112-token prompt, greedy, ignore_eos.
Batch 1: streamed requests one after another, ms/token = (last chunk - first chunk) /
(tokens - 1), best of --repeats. Concurrent: --concurrency requests at once, output tok/s =
completion tokens / wall time. Resident sets: our engine (scheduler) process and the whole
server, minus the KV pool (exact: from /server_info's token capacity and the model's
shape); llama-server's whole process and its f16 KV cache. Without --llama-server only our
server runs. One JSON line per engine (``--output`` appends them to a file).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.report import emit  # noqa: E402
from minisgl.distributed.group import physical_cores  # noqa: E402
from minisgl.models.default_model import default_model_path  # noqa: E402
from minisgl.models.gguf_loader import gguf_hf_config  # noqa: E402

PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based inks and a screw press adapted from "
    "wine making. Books, which had been copied by hand for centuries, could now be produced "
    "in hundreds of identical copies. Within fifty years presses were running in more than "
    "two hundred European cities, and the price of a book fell so far that students, "
    "merchants and craftsmen could own them. Write a detailed essay about what changed for "
    "ordinary readers, for scholars, and for the churches of the time."
)


def kv_bytes_per_token(model: Path, elem: int) -> int:
    cfg = gguf_hf_config(model)
    dims = int(str(cfg["num_key_value_heads"])) * int(str(cfg["head_dim"]))
    return 2 * int(str(cfg["num_hidden_layers"])) * dims * elem


async def completion(session: aiohttp.ClientSession, url: str, tokens: int, stream: bool) -> dict:
    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    body |= {"stream": stream, "model": "default"}
    times: list[float] = []
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        if not stream:
            return {"usage": (await resp.json())["usage"]}
        async for line in resp.content:
            text = line.decode().strip()
            if text.startswith("data:") and text != "data: [DONE]":
                if json.loads(text[5:])["choices"][0].get("text"):
                    times.append(time.perf_counter())
    return {"chunks": times}


async def measure(url: str, tokens: int, repeats: int, concurrency: int) -> dict[str, float]:
    timeout = aiohttp.ClientTimeout(total=1800)
    # A fresh connection per request: llama-server drops idle keep-alive connections.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await completion(session, url, 8, False)  # warm-up
        per_token = []
        for _ in range(repeats):
            chunks = (await completion(session, url, tokens, True))["chunks"]
            per_token.append((chunks[-1] - chunks[0]) / (len(chunks) - 1) * 1000)
        t0 = time.perf_counter()
        jobs = [completion(session, url, tokens, False) for _ in range(concurrency)]
        done = await asyncio.gather(*jobs)
        wall = time.perf_counter() - t0
    out_tokens = sum(d["usage"]["completion_tokens"] for d in done)
    prompt_tokens = done[0]["usage"]["prompt_tokens"]
    return {
        "batch1_ms_per_token": round(min(per_token), 2),
        "batch1_ms_per_token_runs": [round(x, 2) for x in per_token],
        "concurrent_output_tok_s": round(out_tokens / wall, 1),
        "prompt_tokens": prompt_tokens,
    }


def wait_ready(url: str, proc: subprocess.Popen[bytes], limit: float = 600) -> None:
    import urllib.request

    deadline = time.time() + limit
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise TimeoutError("server did not come up")


def rss_mib(proc: subprocess.Popen[bytes]) -> tuple[float, float]:
    """(largest process, whole tree) resident set in MiB."""
    root = psutil.Process(proc.pid)
    sizes = [p.memory_info().rss for p in [root, *root.children(recursive=True)]]
    return max(sizes) / 2**20, sum(sizes) / 2**20


def run_engine(name: str, cmd: list[str], url: str, args: argparse.Namespace) -> dict:
    log = open(f"/tmp/bench_cpu_peer_{name}.log", "wb")  # noqa: SIM115 (the server writes it)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc)
        result = asyncio.run(measure(url, args.tokens, args.repeats, args.concurrency))
        engine_rss, total_rss = rss_mib(proc)
        if name == "minisgl":
            import urllib.request

            with urllib.request.urlopen(f"{url}/server_info") as r:
                capacity = int(json.load(r)["max_total_tokens"])
            kv = capacity * kv_bytes_per_token(args.model, 4) / 2**20  # float32 pool
        else:
            kv = args.llama_ctx * kv_bytes_per_token(args.model, 2) / 2**20  # f16 cache
        result |= {
            "engine_rss_mib": round(engine_rss, 1),
            "server_rss_mib": round(total_rss, 1),
            "kv_mib": round(kv, 1),
            "engine_rss_minus_kv_mib": round(engine_rss - kv, 1),
        }
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return {"bench": "cpu_peer", "engine": name, "threads": args.threads, **result}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF file (default: bundled)")
    ap.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server")
    ap.add_argument("--threads", type=int, default=physical_cores())
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--port", type=int, default=30123)
    ap.add_argument("--output", default=None)
    ap.add_argument("--only-llama", action="store_true", help="skip our server")
    args = ap.parse_args()
    args.model = args.model or default_model_path()
    args.llama_ctx = args.concurrency * 512
    ours = [sys.executable, "-m", "minisgl", "--model", str(args.model), "--port", str(args.port)]
    ours += ["--cpu-threads", str(args.threads)]
    runs = [] if args.only_llama else [("minisgl", ours, f"http://127.0.0.1:{args.port}")]
    if args.llama_server:
        llama = [args.llama_server, "-m", str(args.model), "-t", str(args.threads)]
        llama += ["--parallel", str(args.concurrency), "-c", str(args.llama_ctx)]
        llama += ["--port", str(args.port + 1), "--no-webui"]
        runs.append(("llama.cpp", llama, f"http://127.0.0.1:{args.port + 1}"))
    for name, cmd, url in runs:
        result = run_engine(name, cmd, url, args)
        emit(result, args.output)


if __name__ == "__main__":
    main()
