"""Tensor parallelism on CPU (2 processes over gloo): TP=2 equals TP=1 token for token, every
rank stays consistent through chunked prefill, the radix cache and aborts, each rank holds
only its shard, and the ranks go away with the LLM (close, garbage collection, parent death,
or a dead peer) instead of hanging the suite."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from minisgl import LLM, SamplingParams, env
from minisgl.cli import build_parser, engine_config
from minisgl.config import EngineConfig
from minisgl.distributed.topology import Topology, free_port, split_addr
from tests.helpers import assert_engine_clean, make_tiny_model

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[3]
SHARED = list(range(10, 50))  # a 40-token prefix: several chunks at chunked_prefill_size=16
PROMPTS = [[5, 6, 7], SHARED + [60, 61], list(range(100, 137)), SHARED + [70], [9] * 13, [200, 3]]
MAX_TOKENS = [6, 5, 7, 4, 6, 5]
FOLLOW_UP = [SHARED + [80, 81, 82], [5, 6, 7, 8], list(range(100, 120))]  # radix hits
SAMPLED = SamplingParams(temperature=0.8, top_k=40, max_tokens=6, ignore_eos=True)
OPTIONS: dict[str, Any] = {"chunked_prefill_size": 16, "num_pages": 512, "cache": "radix"}


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(autouse=True)
def _short_dist_timeout() -> Iterator[None]:
    # Spawned ranks inherit it: a divergence fails in a minute instead of ten.
    with env.override({env.DIST_TIMEOUT_S: 60}):
        yield


@pytest.fixture(scope="module")
def models(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    kv1 = make_tiny_model(
        tmp_path_factory.mktemp("tp") / "llama_kv1", "llama", num_key_value_heads=1
    )
    # Qwen3-MoE: each expert's intermediate dimension is sharded across the ranks.
    moe = make_tiny_model(tmp_path_factory.mktemp("tp") / "moe", "qwen3_moe")
    return {
        "llama": tiny_models["llama"],
        "llama_kv1": kv1,
        "qwen3": tiny_models["qwen3"],
        "qwen3_moe": moe,
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


def test_tp2_structured_output_matches_tp1(models: dict[str, Path]) -> None:
    """Every rank keeps its own grammar matchers, fed the same tokens: constrained requests
    (mixed with a free one) give TP=1's tokens. The tiny tokenizer's words are t3, t4, ...:
    the regex allows one of t10..t19, then one of t20..t29, then only EOS (</s>, id 2)."""
    pytest.importorskip("xgrammar")
    path = str(models["llama"])
    params = [
        SamplingParams(temperature=0, max_tokens=8, regex="t1[0-9]t2[0-9]"),
        SamplingParams(temperature=0.9, seed=3, max_tokens=8, regex="t1[0-9]t2[0-9]"),
        _greedy(6),
    ]
    prompts = [[5, 6, 7], [8, 9], [10, 11]]
    ref = LLM(path, **OPTIONS).generate(prompts, params)
    for out in ref[:2]:
        ids = out["token_ids"]
        assert 10 <= ids[0] <= 19 and 20 <= ids[1] <= 29 and ids[2:] == [2], ids
        assert out["finish_reason"] == "stop"
    with LLM(path, tp_size=2, **OPTIONS) as llm:
        assert llm.generate(prompts, params) == ref
        assert_engine_clean(llm)


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


def _server_follower(config: EngineConfig, out: Any) -> None:
    """Rank 1 of a `RankSync` test: what the server's non-zero ranks do, minus the model."""
    import torch

    from minisgl.distributed import TPInfo
    from minisgl.distributed.group import destroy_tp_group, init_tp_group
    from minisgl.tp.server_sync import RankSync

    tp = TPInfo(1, 2)
    init_tp_group(config, tp, torch.device("cpu"))
    sync = RankSync(tp)
    seen = []
    while (msgs := sync.exchange()) is not None:
        seen.append(msgs)
        sync.gather(len(msgs))
    out.put(seen)
    destroy_tp_group()


@contextlib.contextmanager
def _rank0_with_follower(
    follower: Any, rank_sync: bool = True
) -> Iterator[tuple[Any, Any, Any, EngineConfig]]:
    """Rank 0 of a two-rank gloo group in this process, ``follower(config, out)`` as rank 1
    in a spawned one; yields rank 0's RankSync (None without ``rank_sync``), rank 1's result
    queue and process, and the config both ranks were started with."""
    import multiprocessing as mp

    import torch

    from minisgl.distributed import TPInfo
    from minisgl.distributed.group import destroy_tp_group, init_tp_group
    from minisgl.tp.server_sync import RankSync

    config = EngineConfig(tp_size=2, dist_init_addr=f"127.0.0.1:{free_port()}")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=follower, args=(config, out), daemon=True)
    proc.start()
    try:
        init_tp_group(config, TPInfo(0, 2), torch.device("cpu"), check=lambda: _alive(proc))
        yield RankSync(TPInfo(0, 2)) if rank_sync else None, out, proc, config
    finally:
        destroy_tp_group()
        if proc.is_alive():
            proc.kill()


def test_server_rank_sync_hands_every_rank_the_same_messages() -> None:
    with _rank0_with_follower(_server_follower) as (sync, out, proc, _):
        sent: list[list[Any]] = [[], [{"rid": 3, "ids": [1, 2]}, ("abort", 3)], [], [{"rid": 4}]]
        for msgs in sent:
            assert sync.exchange(msgs) == msgs
            assert sync.gather(len(msgs)) == [len(msgs), len(msgs)]
        sync.stop()
        assert out.get(timeout=120) == sent
        proc.join(30)
        assert proc.exitcode == 0


def _mismatched_follower(config: EngineConfig, out: Any) -> None:
    """Rank 1 started with another --page-size than rank 0 (as a second node could be)."""
    import dataclasses

    import torch

    from minisgl.distributed import TPInfo
    from minisgl.distributed.group import destroy_tp_group, init_tp_group
    from minisgl.tp.server_sync import RankSync

    init_tp_group(config, TPInfo(1, 2), torch.device("cpu"))
    sync = RankSync(TPInfo(1, 2))
    assert sync.share(None) == 7  # rank 0's value, whatever this rank was given
    try:
        sync.require_same(dataclasses.replace(config, page_size=4), "engine flags")
        out.put("accepted")
    except Exception as exc:
        out.put(str(exc))
    destroy_tp_group()


def test_server_ranks_take_rank0_settings_and_refuse_other_engine_flags() -> None:
    from minisgl.distributed.channel import ProtocolMismatch

    with _rank0_with_follower(_mismatched_follower) as (sync, out, proc, config):
        assert sync.share(7) == 7
        with pytest.raises(ProtocolMismatch, match=r"rank 1: page_size=4 \(rank 0: 1\)"):
            sync.require_same(config, "engine flags")
        assert "page_size=4 (rank 0: 1)" in out.get(timeout=120)
        proc.join(30)
        assert proc.exitcode == 0


def test_topology_and_flags() -> None:
    t = Topology(tp_size=8, nnodes=2, node_rank=1)
    assert t.ranks_per_node == 4 and t.node_ranks == [4, 5, 6, 7]
    assert [t.local_rank(r) for r in (0, 3, 4, 7)] == [0, 3, 0, 3]
    assert t.node_of(5) == 1 and not t.holds_rank0 and Topology(2).holds_rank0
    assert split_addr("10.0.0.1:5000") == ("10.0.0.1", 5000)
    assert split_addr("[::1]:29500") == ("::1", 29500)

    args = build_parser().parse_args(
        ["--tp-size", "4", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:5000"]
    )
    cfg = engine_config(args)
    assert (cfg.tp_size, cfg.nnodes, cfg.node_rank, cfg.dist_init_addr) == (
        4,
        2,
        1,
        "10.0.0.1:5000",
    )
    for bad in (
        {"tp_size": 3, "nnodes": 2, "dist_init_addr": "h:1"},  # nnodes must divide tp_size
        {"tp_size": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"},
        {"tp_size": 2, "nnodes": 2},  # multi-node needs rank 0's address
        {"tp_size": 2, "dist_init_addr": "no-port"},
        {"tp_size": 2, "dist_init_addr": "h:70000"},
        {"nnodes": 0},
    ):
        with pytest.raises(ValueError):
            EngineConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="node 0"):
        LLM(tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1")


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


def _alive(proc: Any) -> None:
    if proc.exitcode is not None:
        raise RuntimeError(f"rank 1 exited with code {proc.exitcode}")


def _peer_setup_follower(config: EngineConfig, out: Any) -> None:
    import torch

    from minisgl.distributed import TPInfo
    from minisgl.distributed.group import destroy_tp_group, init_tp_group
    from minisgl.distributed.reducer import active_reducer, register_reducer, setup_reducer
    from minisgl.extension_loader import load_extensions

    load_extensions()  # the same factories, in the same order, as rank 0's
    register_reducer(_rank0_only_reducer)
    init_tp_group(config, TPInfo(1, 2), torch.device("cpu"))
    seen: list[object] = []
    for _ in range(2):
        seen.append(_open_peer_reducer())
        seen.append(_marker_sum(1))
    setup_reducer(config, torch.device("cpu"))
    seen += [active_reducer() is not None, _marker_sum(1)]
    register_reducer(_rank0_only_reducer)  # one provider more than rank 0 has
    try:
        setup_reducer(config, torch.device("cpu"))
    except RuntimeError as e:
        seen.append("same minisgl extensions" in str(e))
    seen.append(_marker_sum(1))
    out.put(seen)
    destroy_tp_group()


def _open_peer_reducer() -> bool:
    """What setup_reducer does with the peer-memory extension's reducer (whose factory
    declines on the CPU before any collective): open it, then agree on the result."""
    import torch

    from minisgl.distributed.reducer import all_ranks_agree
    from minisgl.extensions.peer_memory.peer_all_reduce import open_reducer

    cpu = torch.device("cpu")
    return all_ranks_agree(open_reducer(cpu, (torch.float32,)) is not None, cpu)


def _rank0_only_reducer(config: EngineConfig, device: Any) -> Any:
    import torch.distributed as dist

    return object() if dist.get_rank() == 0 else None


def _marker_sum(rank: int) -> int:
    """A collective after setup: had the ranks' setups taken different collectives, this
    one would pair with a setup's and give another sum (or hang)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([10 * rank + 7])
    dist.all_reduce(t)
    return int(t.item())


def test_reducer_setup_is_agreed_by_every_rank() -> None:
    """The ranks take a reducer (distributed/reducer.py) together or not at all (one rank in
    another kernel would wait for ever). The peer-memory one: rank 0 having used it before
    in its process (rank 1 is fresh), then a buffer that cannot be made (CPU); then a
    reducer that one rank gets and the other not: every time every rank keeps the process
    group's all-reduce, and nobody hangs. Ranks with different providers registered fail
    with a clear error instead of pairing each other's setup collectives."""
    import torch

    from minisgl.distributed import reducer
    from minisgl.extensions.peer_memory import peer_all_reduce

    reducer.register_reducer(_rank0_only_reducer)
    try:
        with _rank0_with_follower(_peer_setup_follower, rank_sync=False) as (_, out, proc, cfg):
            peer_all_reduce._used_in_process = True  # a TP run of this process used it
            assert not _open_peer_reducer()
            assert _marker_sum(0) == 24
            peer_all_reduce._used_in_process = False
            assert not _open_peer_reducer()  # no symmetric memory on the CPU
            assert _marker_sum(0) == 24
            reducer.setup_reducer(cfg, torch.device("cpu"))
            assert reducer.active_reducer() is None
            assert _marker_sum(0) == 24
            with pytest.raises(RuntimeError, match="same minisgl extensions"):
                reducer.setup_reducer(cfg, torch.device("cpu"))  # rank 1 has one more
            assert _marker_sum(0) == 24
            assert out.get(timeout=120) == [False, 24, False, 24, False, 24, True, 24]
            proc.join(30)
            assert proc.exitcode == 0
    finally:
        peer_all_reduce._used_in_process = False
        reducer._factories.remove(_rank0_only_reducer)
