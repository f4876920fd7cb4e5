"""The online benchmark against a real server (the tiny random model): every request
succeeds, the JSON and PNG are written, and the client's figures agree with /metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.e2e.server_utils import REPO, ServerHandle, wait_idle_and_check

BENCH = REPO / "benchmark" / "online" / "bench_serving.py"
TINY = ["--vocab-size", "256", "--warmup-requests", "1", "--flush-cache"]  # ids < tiny vocab


def run_bench(server: ServerHandle, out: Path, *args: str) -> dict[str, Any]:
    cmd = [sys.executable, str(BENCH), "--base-url", server.base_url, "--output", str(out)]
    proc = subprocess.run(
        [*cmd, *TINY, *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert out.is_file() and out.with_suffix(".png").is_file()
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "server /metrics" in proc.stdout  # the side-by-side table was printed
    return json.loads(out.read_text())


def check_agreement(run: dict[str, Any], n: int) -> None:
    s, client, server = run["summary"], run["client"], run["server"]
    assert s["completed"] == n and s["failed"] == 0, run["errors"]
    assert len(run["requests"]) == n
    # ignore_eos + max_tokens fix every length; the usage reports exactly that.
    assert s["total_output_tokens"] == s["expected_output_tokens"]
    # The server counted exactly the tokens and requests of this run.
    assert server["output_tokens"] == client["output_tokens"]
    assert server["prompt_tokens"] == client["prompt_tokens"]
    assert server["cached_tokens"] == client["cached_tokens"]
    assert server["requests"] == n
    # Latencies: the client adds HTTP and SSE on top; generous factors for a shared CPU.
    for key in ("ttft_mean_ms", "e2e_mean_ms"):
        assert 0.5 * server[key] - 5 <= client[key] <= 3 * server[key] + 100, (key, client, server)
    itl_c, itl_s = client["itl_mean_ms"], server["itl_mean_ms"]
    assert 0.3 * itl_s - 5 <= itl_c <= 3 * itl_s + 50, (client, server)


def test_random_completions_agree_with_server_metrics(
    tiny_server: ServerHandle, tmp_path: Path
) -> None:
    result = run_bench(
        tiny_server, tmp_path / "random.json",
        "--num-prompts", "16", "--random-input-len", "16:64", "--random-output-len", "8:16",
        "--request-rate", "32", "--label", "tiny",
    )  # fmt: skip
    assert result["label"] == "tiny" and result["config"]["num_requests"] == 16
    [run] = result["runs"]
    check_agreement(run, 16)
    assert all(r["ttft_ms"] is not None and r["output_tokens"] >= 8 for r in run["requests"])
    wait_idle_and_check(tiny_server)


def test_client_processes_share_one_schedule(tiny_server: ServerHandle, tmp_path: Path) -> None:
    """--client-processes 2: the requests are sent by two client processes on one clock;
    every record comes back in order and the totals still agree with the server's."""
    from benchmark.online.bench_serving import build_requests, parse_args

    args = ["--num-prompts", "12", "--random-input-len", "16:32", "--random-output-len", "6:9"]
    result = run_bench(tiny_server, tmp_path / "two.json", *args, "--client-processes", "2")
    [run] = result["runs"]
    check_agreement(run, 12)
    # Request i's record is request i's: the prompt lengths the server reported, in order.
    sent = build_requests(parse_args([*TINY, *args]))
    assert [r["prompt_tokens"] for r in run["requests"]] == [q.prompt_len for q in sent]
    wait_idle_and_check(tiny_server)


def test_trace_replay_through_generate_reuses_prefixes(
    tiny_server: ServerHandle, tmp_path: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 100 * i, "input_length": 40, "output_length": 6, "hash_ids": [0, 1 + i % 2]}
        for i in range(8)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = run_bench(
        tiny_server, tmp_path / "trace.json", "--backend", "generate", "--dataset", "trace",
        "--trace-file", str(trace), "--trace-block-size", "16", "--trace-time-scale", "0.5",
    )  # fmt: skip
    [run] = result["runs"]
    check_agreement(run, 8)
    # Hash id 0 is a 16-token block every row shares: the radix cache serves it (at least
    # once; rows admitted in one batch may each compute it).
    assert run["summary"]["total_cached_tokens"] >= 16
    wait_idle_and_check(tiny_server)


def test_chat_sweep_with_text_prompts(
    tiny_server: ServerHandle, tiny_model: Path, tmp_path: Path
) -> None:
    result = run_bench(
        tiny_server, tmp_path / "sweep.json", "--backend", "chat", "--tokenizer", str(tiny_model),
        "--num-prompts", "6", "--random-input-len", "8:24", "--random-output-len", "6",
        "--sweep-rates", "20,inf",
    )  # fmt: skip
    assert [r["request_rate"] for r in result["runs"]] == [20.0, "inf"]
    for run in result["runs"]:
        check_agreement(run, 6)
        assert run["summary"]["total_output_tokens"] == 36
    wait_idle_and_check(tiny_server)
