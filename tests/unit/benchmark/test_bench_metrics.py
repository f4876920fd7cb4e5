"""The online benchmark's metric functions, workloads and parsers, on synthetic inputs with
known answers (no server)."""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path

import pytest

from benchmark.online import datasets, server_metrics
from benchmark.online.backends import Endpoint, build_payload
from benchmark.online.metrics import RequestRecord, describe, percentile, summarize


def record(
    start: float, chunks: list[float], end: float, out: int, prompt: int = 10
) -> RequestRecord:
    return RequestRecord(
        start=start, chunk_times=chunks, end=end, success=True, prompt_tokens=prompt,
        output_tokens=out,
    )  # fmt: skip


# ---------------------------------------------------------------- per request
def test_ttft_itl_tpot_e2e_of_one_request() -> None:
    r = record(10.0, [10.5, 10.6, 10.8, 11.0], 11.05, out=4)
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.1, 0.2, 0.2])
    assert r.latency == pytest.approx(1.05)
    # TPOT uses the server's token count, not the chunk count: (E2E - TTFT) / (tokens - 1).
    assert r.tpot == pytest.approx(0.55 / 3)
    r.output_tokens = 12  # e.g. chunks carrying several tokens
    assert r.tpot == pytest.approx(0.55 / 11)


def test_one_token_has_no_tpot_and_no_chunks_no_ttft() -> None:
    assert record(0.0, [0.3], 0.3, out=1).tpot is None
    empty = record(0.0, [], 0.3, out=0)
    assert empty.ttft is None and empty.tpot is None and empty.itl == []
    as_json = record(1.0, [1.25, 1.5], 1.5, out=2).to_json()
    assert as_json["ttft_ms"] == 250.0 and as_json["itl_ms"] == [250.0]
    assert as_json["tpot_ms"] == 250.0 and as_json["e2e_ms"] == 500.0


# ---------------------------------------------------------------- percentiles
def test_percentile_known_values_and_numpy_agreement() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([1, 2, 3, 4, 5], 90) == pytest.approx(4.6)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    np = pytest.importorskip("numpy")
    rng = random.Random(3)
    xs = [rng.expovariate(1.0) for _ in range(101)]
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_describe_scales_to_ms() -> None:
    d = describe([0.1, 0.2, 0.3, 0.4])
    assert d["count"] == 4
    assert d["mean"] == pytest.approx(250.0) and d["p50"] == pytest.approx(250.0)
    assert d["min"] == pytest.approx(100.0) and d["max"] == pytest.approx(400.0)
    assert math.isnan(describe([])["p99"])


# ---------------------------------------------------------------- aggregate
def test_summarize_pools_itl_and_computes_throughput() -> None:
    a = record(0.0, [0.2, 0.3, 0.4], 0.4, out=3, prompt=100)  # gaps 0.1, 0.1
    b = record(0.5, [1.5, 1.9], 2.0, out=5, prompt=50)  # gap 0.4
    failed = RequestRecord(start=0.1, end=0.2, error="HTTP 500")
    s = summarize([a, b, failed], duration=4.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["total_input_tokens"] == 150 and s["total_output_tokens"] == 8
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["output_throughput"] == pytest.approx(2.0)
    assert s["input_throughput"] == pytest.approx(37.5)
    assert s["total_token_throughput"] == pytest.approx(39.5)
    # ITL is pooled over gaps, not averaged per request: (0.1 + 0.1 + 0.4) / 3.
    assert s["itl_ms"]["count"] == 3
    assert s["itl_ms"]["mean"] == pytest.approx(200.0)
    assert s["itl_ms"]["p50"] == pytest.approx(100.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(600.0)  # (0.2 + 1.0) / 2
    assert s["tpot_ms"]["mean"] == pytest.approx((100.0 + 125.0) / 2)  # 0.2/2 and 0.5/4
    assert s["e2e_ms"]["mean"] == pytest.approx(950.0)
    assert s["concurrency"] == pytest.approx(1.9 / 4.0)  # Little's law


# ---------------------------------------------------------------- arrivals
def test_poisson_arrivals_are_seeded_sorted_and_mean_correct() -> None:
    t = datasets.arrival_times(20000, rate=4.0, seed=7)
    assert t == datasets.arrival_times(20000, rate=4.0, seed=7)
    assert t != datasets.arrival_times(20000, rate=4.0, seed=8)
    gaps = [b - a for a, b in zip([0.0, *t[:-1]], t, strict=True)]
    assert all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(0.25, rel=0.05)
    bursty = datasets.arrival_times(20000, rate=4.0, seed=7, burstiness=0.25)
    bursty_gaps = [b - a for a, b in zip([0.0, *bursty[:-1]], bursty, strict=True)]
    assert statistics.fmean(bursty_gaps) == pytest.approx(0.25, rel=0.08)
    assert statistics.pstdev(bursty_gaps) > 1.5 * statistics.pstdev(gaps)
    assert datasets.arrival_times(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        datasets.arrival_times(3, 0.0, seed=0)


# ---------------------------------------------------------------- workloads
def test_parse_range() -> None:
    assert datasets.parse_range("128") == (128, 128)
    assert datasets.parse_range("64:256") == (64, 256)
    assert datasets.parse_range("64-256") == (64, 256)
    with pytest.raises(ValueError):
        datasets.parse_range("9:3")


def test_random_and_shared_prefix_workloads() -> None:
    reqs = datasets.random_requests(50, (64, 256), (32, 64), vocab=1000, seed=1)
    assert reqs == datasets.random_requests(50, (64, 256), (32, 64), vocab=1000, seed=1)
    assert all(64 <= r.prompt_len <= 256 and 32 <= r.output_len <= 64 for r in reqs)
    assert all(datasets.MIN_TOKEN_ID <= i < 1000 for r in reqs for i in r.body)
    gsp = datasets.shared_prefix_requests(3, 4, 40, 8, 16, vocab=1000, seed=0)
    assert len(gsp) == 12 and all(r.prompt_len == 48 and r.output_len == 16 for r in gsp)
    prefixes = [tuple(r.prefix) for r in gsp]
    assert len(set(prefixes)) == 3 and prefixes[:4] == [prefixes[0]] * 4  # group by group
    assert len({tuple(r.body) for r in gsp}) == 12


def test_trace_formats_arrivals_and_hash_blocks(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 1000, "input_length": 20, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 1500, "input_length": 30, "output_length": 0, "hash_ids": [0, 2]},
        {"timestamp": 3000, "input_length": 10, "output_length": 7},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    loaded = datasets.load_trace_rows(path)
    assert loaded == rows and datasets.load_trace_rows(path, limit=2) == rows[:2]
    assert datasets.detect_trace_format(rows) == "mooncake"
    reqs = datasets.trace_requests(rows, vocab=1000, seed=0, block_size=8, time_scale=0.5)
    assert [r.arrival for r in reqs] == pytest.approx([0.0, 0.25, 1.0])  # ms x 0.5
    assert [r.prompt_len for r in reqs] == [20, 30, 10]
    assert [r.output_len for r in reqs] == [5, 1, 7]
    assert reqs[0].body[:8] == reqs[1].body[:8]  # hash id 0: the same block
    assert reqs[0].body[8:16] != reqs[1].body[8:16]
    qwen = [{"timestamp": 0.5, "input_length": 40, "output_length": 3, "hash_ids": [4, 5, 6]}]
    qwen.append({"timestamp": 2.0, "input_length": 33, "output_length": 3, "hash_ids": [4, 5]})
    assert datasets.detect_trace_format(qwen) == "qwen"
    q = datasets.trace_requests(qwen, vocab=1000, seed=0)
    assert [r.arrival for r in q] == pytest.approx([0.0, 1.5])  # seconds
    assert q[0].body[:32] == q[1].body[:32]  # 16-token blocks 4, 5


def test_payloads_of_each_backend() -> None:
    req = datasets.BenchRequest(body=[7, 8], output_len=4, prefix=[5, 6])
    ep = Endpoint("http://h:1/", "completions", model="m")
    body = build_payload(ep, req)
    assert ep.url == "http://h:1/v1/completions"
    assert body["prompt"] == [5, 6, 7, 8] and body["max_tokens"] == 4 and body["ignore_eos"]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    chat = build_payload(Endpoint("http://h:1", "chat", model="m"), req)
    assert [m["role"] for m in chat["messages"]] == ["system", "user"]
    render = datasets.Renderer()
    assert chat["messages"][0]["content"] == render([5, 6]) and render([5, 6]) == render([5, 6])
    gen = build_payload(Endpoint("http://h:1", "generate", extra_body={"rid": "x"}), req)
    assert gen["input_ids"] == [5, 6, 7, 8] and gen["rid"] == "x"
    assert gen["sampling_params"] == {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    text = build_payload(Endpoint("http://h:1", "generate", prompt_format="text"), req)
    assert text["text"] == render([5, 6]) + render([7, 8])


# ---------------------------------------------------------------- /metrics
PROM = """# HELP minisgl_generation_tokens_total Tokens generated
# TYPE minisgl_generation_tokens_total counter
minisgl_generation_tokens_total {gen}
minisgl_prompt_tokens_total 500.0
minisgl_cached_prompt_tokens_total 64.0
minisgl_requests_total{{finish_reason="length"}} {req}
minisgl_requests_total{{finish_reason="stop"}} 1.0
minisgl_time_to_first_token_seconds_bucket{{le="0.1"}} 3.0
minisgl_time_to_first_token_seconds_sum {ttft_sum}
minisgl_time_to_first_token_seconds_count {req_all}
"""


def test_prometheus_parse_delta_and_server_view() -> None:
    before = server_metrics.parse_prometheus(
        PROM.format(gen=10.0, req=2.0, ttft_sum=0.3, req_all=3.0)
    )
    assert before["minisgl_requests_total"] == 3.0  # summed over finish reasons
    assert "minisgl_time_to_first_token_seconds_bucket" not in before
    after = server_metrics.parse_prometheus(
        PROM.format(gen=110.0, req=6.0, ttft_sum=1.1, req_all=7.0)
    )
    view = server_metrics.server_view(server_metrics.delta(before, after))
    assert view["output_tokens"] == 100.0 and view["requests"] == 4.0
    assert view["prompt_tokens"] == 0.0 and view["cached_tokens"] == 0.0
    assert view["ttft_mean_ms"] == pytest.approx(200.0)  # 0.8 s over 4 first tokens
    assert view["itl_mean_ms"] is None  # no such histogram in this scrape
    vllm = server_metrics.parse_prometheus('vllm:generation_tokens_total{model="x"} 42\n')
    assert server_metrics.server_view(vllm)["output_tokens"] == 42.0


def test_engine_args_parse_json_values_and_keep_names() -> None:
    from benchmark.report import engine_options

    opts = engine_options(
        ["tp_size=2", "disable-custom-all-reduce=true", "attention_backend=flashinfer",
         "context_length=1024", "dtype=float32"],
        load_format="dummy", context_length=4096,
    )  # fmt: skip
    assert opts == {
        "load_format": "dummy", "context_length": 1024, "tp_size": 2,
        "disable_custom_all_reduce": True, "attention_backend": "flashinfer", "dtype": "float32",
    }  # fmt: skip


def test_client_processes_option_is_checked() -> None:
    import pytest

    from benchmark.online.bench_serving import parse_args

    assert parse_args(["--client-processes", "4"]).client_processes == 4
    for bad in (["--client-processes", "0"], ["--client-processes", "2", "--max-concurrency", "8"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
