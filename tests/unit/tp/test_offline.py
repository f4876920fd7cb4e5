"""Tensor parallelism offline on CPU (2 processes over gloo): TP=2 equals TP=1 token for
token, every rank stays consistent through chunked prefill, the radix cache and aborts, each
rank holds only its shard, two simulated nodes work, and the ranks go away with the LLM
(close, garbage collection, parent death, or a dead peer) instead of hanging the suite."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from minisgl import LLM, SamplingParams
from minisgl.distributed.topology import free_port
from tests.helpers import TinyModels, assert_engine_clean

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("short_dist_timeout")]

REPO = Path(__file__).resolve().parents[3]
SHARED = list(range(10, 50))  # a 40-token prefix: several chunks at chunked_prefill_size=16
PROMPTS = [[5, 6, 7], SHARED + [60, 61], list(range(100, 137)), SHARED + [70], [9] * 13, [200, 3]]
MAX_TOKENS = [6, 5, 7, 4, 6, 5]
FOLLOW_UP = [SHARED + [80, 81, 82], [5, 6, 7, 8], list(range(100, 120))]  # radix hits
SAMPLED = SamplingParams(temperature=0.8, top_k=40, max_tokens=6, ignore_eos=True)
OPTIONS: dict[str, Any] = {"chunked_prefill_size": 16, "num_pages": 512, "cache": "radix"}


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tiny_models: TinyModels) -> dict[str, Path]:
    return {
        "llama": tiny_models["llama"],
        "llama_kv1": tiny_models.build("llama", num_key_value_heads=1),
        "qwen3": tiny_models["qwen3"],
        # Qwen3-MoE: each expert's intermediate dimension is sharded across the ranks.
        "qwen3_moe": tiny_models["qwen3_moe"],
    }


def _run(llm: LLM) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    first = llm.generate(PROMPTS, [_greedy(n) for n in MAX_TOKENS])
    second = llm.generate(FOLLOW_UP, _greedy(5))
    return first, second


def _abort_mid_run(llm: LLM) -> tuple[Any, Any, Any]:
    """One request aborted while decoding, one mid chunked prefill; one left to finish."""
    s = llm.scheduler
    decoding, prefilling, survivor = s.add_requests(
        [([30, 31, 32], _greedy(12)), (list(range(150, 210)), _greedy(4)), ([7, 8, 9], _greedy(8))]
    )
    for _ in range(50):
        if len(decoding.output_ids) >= 2:
            break
        s.step()
    assert 0 < prefilling.kv_len < len(prefilling.prompt_ids), "not caught mid-prefill"
    s.abort(decoding.uid)
    s.abort(prefilling.uid)
    while s.has_work:
        s.step()
    s.drain()
    return decoding, prefilling, survivor


def _sharded(name: str) -> bool:
    return any(
        k in name
        for k in (
            "qkv_proj",
            "o_proj",
            "gate_up_proj",
            "down_proj",
            "embed",
            "lm_head",
            ".w13",
            ".w2",
        )
    )


@pytest.mark.parametrize(
    ("name", "page_size"), [("llama", 1), ("llama_kv1", 4), ("qwen3", 2), ("qwen3_moe", 1)]
)
def test_tp2_matches_tp1_and_ranks_agree(
    models: dict[str, Path], name: str, page_size: int
) -> None:
    path = str(models[name])
    ref = LLM(path, page_size=page_size, **OPTIONS)
    ref_first, ref_second = _run(ref)
    ref_sampled = ref.generate([[5, 6, 7], [8, 9]], SAMPLED)
    ref_survivor = ref.generate([[7, 8, 9]], _greedy(8))[0]["token_ids"]
    full = {n: p.numel() for n, p in ref.engine.model.named_parameters()}
    del ref

    with LLM(path, tp_size=2, page_size=page_size, **OPTIONS) as llm:
        pid = llm.followers.pids[1]
        first, second = _run(llm)
        assert first == ref_first  # tokens, text, finish reasons, cached-token counts
        assert second == ref_second
        assert any(r["cached_tokens"] > 0 for r in second)  # the radix cache was hit
        # Unseeded sampling: rank 0 draws each seed from the engine seed as TP=1 does and
        # sends it; the digest check compares what every rank produced, step by step.
        assert llm.generate([[5, 6, 7], [8, 9]], SAMPLED) == ref_sampled
        llm.scheduler.check_integrity()
        assert_engine_clean(llm)

        decoding, prefilling, survivor = _abort_mid_run(llm)
        assert decoding.finish_reason == prefilling.finish_reason == "abort"
        assert survivor.output_ids == ref_survivor
        reports = llm.scheduler.reports()
        assert [r["error"] for r in reports] == [None, None]
        assert len({r["digest"] for r in reports}) == 1 and reports[0]["steps"] > 10
        assert len({(r["free_pages"], r["evictable_pages"]) for r in reports}) == 1
        assert_engine_clean(llm)

        # Rank 1 holds about half of every sharded weight, in storage of its own.
        shapes, storage = reports[1]["param_shapes"], reports[1]["param_storage_bytes"]
        assert shapes == reports[0]["param_shapes"]
        kv1 = name == "llama_kv1"
        for n, shape in shapes.items():
            numel = 1
            for d in shape:
                numel *= d
            assert storage[n] == numel * 4, n  # float32, nothing larger kept alive
            if not _sharded(n):
                assert numel == full[n], n
            elif kv1 and "qkv_proj" in n:
                hidden, head_dim = 64, 16  # q: 2 of 4 heads; k, v: the one KV head, replicated
                assert numel == (2 + 1 + 1) * head_dim * hidden, n
            else:
                assert numel * 2 == full[n], n
        assert sum(1 for n in shapes if _sharded(n)) >= 10
    _assert_exits(pid)


def test_tp2_dummy_weights_are_the_tp1_model(models: dict[str, Path]) -> None:
    """--load-format dummy: each rank loads its shard of one random checkpoint, so TP=2 gives
    TP=1's greedy tokens (benchmarks compare the two on dummy weights)."""
    path = str(models["qwen3"])
    ref = LLM(path, load_format="dummy", **OPTIONS).generate(PROMPTS, _greedy(12))
    with LLM(path, tp_size=2, load_format="dummy", **OPTIONS) as llm:
        assert llm.generate(PROMPTS, _greedy(12)) == ref


def test_multi_node_flags_two_simulated_nodes(models: dict[str, Path]) -> None:
    """Node 1 (one rank) is a separate launcher process, as on a second machine."""
    path = str(models["llama"])
    ref = LLM(path, **OPTIONS).generate(PROMPTS[:3], _greedy(5))
    addr = f"127.0.0.1:{free_port()}"
    node1 = subprocess.Popen(
        [sys.executable, "-m", "minisgl.tp.launch", "--model", path, "--tp-size", "2",
         "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr, "--log-level", "warning",
         "--chunked-prefill-size", "16", "--num-pages", "512"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        llm = LLM(path, tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr, **OPTIONS)
        try:
            assert llm.followers.procs == {}  # node 0 holds rank 0 only
            assert llm.generate(PROMPTS[:3], _greedy(5)) == ref
            llm.scheduler.check_integrity()
        except BaseException:
            llm.close()
            raise
        del llm  # garbage collection stops the ranks, here those of the other "node"
        gc.collect()
        assert node1.wait(timeout=120) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_ranks_exit_when_rank0_dies_or_a_rank_dies(models: dict[str, Path]) -> None:
    script = (
        "import sys, time\n"
        "from minisgl import LLM\n"
        f"llm = LLM({str(models['llama'])!r}, tp_size=2, num_pages=64)\n"
        "print(llm.followers.pids[1], flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        assert parent.stdout is not None
        follower = int(parent.stdout.readline())
        parent.kill()  # SIGKILL: no finalizer, no atexit
        parent.wait()
        _assert_exits(follower)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()

    # The reverse: a follower dies; rank 0 fails at its next call instead of hanging.
    with LLM(str(models["llama"]), tp_size=2, num_pages=64) as llm:
        os.kill(llm.followers.pids[1], signal.SIGKILL)
        _assert_exits(llm.followers.pids[1])
        started = time.monotonic()
        with pytest.raises(RuntimeError):
            llm.generate([[5, 6, 7]], _greedy(4))
        assert time.monotonic() - started < 30
        with pytest.raises(RuntimeError, match="out of step"):
            llm.generate([[5, 6, 7]], _greedy(4))
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[5, 6, 7]], _greedy(4))


def _assert_exits(pid: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        # A zombie (exited, not yet reaped by its parent) counts as gone.
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                return
        except OSError:
            return
        time.sleep(0.1)
    raise AssertionError(f"process {pid} still running after {timeout}s")
