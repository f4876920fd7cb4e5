"""The server with tensor parallelism on CPU (2 scheduler ranks over gloo): through the OpenAI
API it answers token for token as --tp-size 1 does, for Llama (2 KV heads, and 1 KV head
replicated on both ranks) and Qwen3, with concurrent, streamed and aborted requests; every
rank stays clean and in step (/debug/integrity); and no process outlives the server, whether
it is stopped (SIGTERM) or a rank dies. Overlap scheduling (the CUDA default) is forced on in
a loop-level test, since CPU runs never pick it."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import openai
import pytest

from minisgl import env
from tests.e2e.server_utils import (
    REPO,
    ServerHandle,
    assert_clean_log,
    pid_alive,
    start_server,
    wait_idle_and_check,
    wait_until,
)
from tests.helpers import TinyModels

pytestmark = pytest.mark.timeout(300)

SHARED = list(range(10, 50))  # a 40-token prefix: radix hits, and several chunks of 16
PROMPTS = [[5, 6, 7], SHARED + [60, 61], list(range(100, 137)), SHARED + [70], [9] * 13, [200, 3]]
MAX_TOKENS = [6, 5, 7, 4, 6, 5]
OPTIONS = ["--chunked-prefill-size", "16", "--num-pages", "2048"]
# A divergence between the ranks fails a collective in a minute instead of ten.
SWITCHES: dict[env.Switch[Any], object] = {env.DIST_TIMEOUT_S: 60}


@pytest.fixture(scope="module")
def models(tiny_models: TinyModels) -> dict[str, Path]:
    return {
        "llama": tiny_models["llama"],  # 4 query heads, 2 KV heads: one KV head per rank
        "llama_kv1": tiny_models.build("llama", num_key_value_heads=1),
        "qwen3": tiny_models["qwen3"],
    }


def _start(path: Path, tp: int, *extra: str) -> ServerHandle:
    args = ["--model", str(path), "--tp-size", str(tp), "--served-model-name", "tiny"]
    return start_server([*args, *OPTIONS, *extra], switches=SWITCHES)


@pytest.fixture
def pair(request: pytest.FixtureRequest, models: dict[str, Path]) -> Iterator[list[ServerHandle]]:
    """A --tp-size 1 and a --tp-size 2 server of one model, started side by side."""
    path = models[request.param]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(_start, path, tp) for tp in (1, 2)]
    servers = [f.result() for f in futures if f.exception() is None]
    for f in futures:
        if (error := f.exception()) is not None:
            for server in servers:  # the other one started: do not leave it running
                server.stop()
            raise error
    yield servers
    for server in servers:
        _stop_cleanly(server)


def _client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0, timeout=120)


def _complete(server: ServerHandle, i: int) -> tuple[str, str, int]:
    c = _client(server).completions.create(
        model="tiny", prompt=PROMPTS[i], max_tokens=MAX_TOKENS[i], temperature=0
    )
    assert c.usage is not None
    return c.choices[0].text, c.choices[0].finish_reason, c.usage.completion_tokens


STOP_PROMPT = [40, 41]


def _stopped(server: ServerHandle, word: str) -> tuple[str, str]:
    """A stop string: every rank decodes the tail to check it (ranks on other nodes with a
    tokenizer they load themselves)."""
    c = _client(server).completions.create(
        model="tiny", prompt=STOP_PROMPT, max_tokens=12, temperature=0, stop=[word]
    )
    return c.choices[0].text, c.choices[0].finish_reason


def _stopped_by_regex(server: ServerHandle, word: str) -> tuple[str, str, Any]:
    """A stop regex: every rank decodes the whole output incrementally to search it, and all
    must end the request at the same token."""
    c = _client(server).completions.create(
        model="tiny", prompt=STOP_PROMPT, max_tokens=12, temperature=0,
        extra_body={"stop_regex": rf"(?<!\S){word}(?!\S)"},
    )  # fmt: skip
    choice = c.choices[0]
    return choice.text, choice.finish_reason, choice.model_extra["matched_stop"]


def _stop_word(text: str) -> str:
    """The 4th word of an answer to STOP_PROMPT: a stop string that ends it early."""
    return text.split()[3]


def _workload(server: ServerHandle, stop_word: str) -> list[Any]:
    """Every request at once: the batches differ between runs, the greedy tokens must not."""
    client = _client(server)

    def chat() -> Any:
        c = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "t7 t8 t9"}], max_tokens=6,
            temperature=0,
        )  # fmt: skip
        return c.choices[0].message.content, c.choices[0].finish_reason

    def stream() -> Any:
        chunks = client.completions.create(
            model="tiny", prompt=SHARED + [80, 81], max_tokens=7, temperature=0, stream=True
        )
        return "".join(ch.choices[0].text for ch in chunks if ch.choices)

    def sampled() -> Any:  # seeded sampling: the per-request seed makes the draws equal too
        c = client.completions.create(
            model="tiny", prompt=[5, 6, 7], max_tokens=6, temperature=0.8, seed=7, n=2
        )
        return [ch.text for ch in c.choices]

    jobs: list[Callable[[], Any]] = [partial(_complete, server, i) for i in range(len(PROMPTS))]
    jobs += [chat, stream, sampled, partial(_stopped_by_regex, server, stop_word)]
    jobs += [partial(_stopped, server, stop_word)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: job(), jobs))


def _abort_mid_decode(server: ServerHandle) -> None:
    """Read a few tokens of a long stream, then hang up: the request is aborted in decode."""
    stream = _client(server).completions.create(
        model="tiny", prompt=[30, 31, 32], max_tokens=400, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    seen = 0
    for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].text)
        if seen >= 3:
            break
    stream.close()


def _assert_ranks_clean(body: dict[str, Any], tp: int) -> None:
    ranks = body["ranks"]
    assert [r["rank"] for r in ranks] == list(range(tp)), body
    assert all(r["error"] is None for r in ranks), body
    assert len({r["digest"] for r in ranks}) == 1 and ranks[0]["steps"] > 0, body
    assert all(r["free_pages"] + r["evictable_pages"] == body["total_pages"] for r in ranks)


def _stop_cleanly(server: ServerHandle) -> None:
    pids = server.child_pids()
    run_dir = server.run_dir()
    assert server.stop(signal.SIGTERM) == 0, server.log()[-3000:]
    assert wait_until(lambda: not any(pid_alive(p) for p in pids.values()), 10), pids
    assert not run_dir.exists()
    assert_clean_log(server)


# One model every day; the other head layouts repeat tests/unit/tp's in-process checks.
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "pair",
    ["llama", pytest.param("llama_kv1", marks=SLOW), pytest.param("qwen3", marks=SLOW)],
    indirect=True,
)
def test_tp2_server_matches_tp1(pair: list[ServerHandle]) -> None:
    single, tp2 = pair
    assert set(tp2.child_pids()) == {"scheduler-tp0", "scheduler-tp1", "tokenizer"}
    answer = _client(single).completions.create(
        model="tiny", prompt=STOP_PROMPT, max_tokens=4, temperature=0
    )
    word = _stop_word(answer.choices[0].text)
    expected = _workload(single, word)
    assert expected[-1][1] == "stop" and expected[-2][1] == "stop", expected
    assert _workload(tp2, word) == expected
    assert _workload(tp2, word) == expected  # again, now mostly from the radix cache

    _abort_mid_decode(tp2)
    body = wait_idle_and_check(tp2)
    assert body["aborts_decode"] == 1, body
    _assert_ranks_clean(body, 2)
    _assert_ranks_clean(wait_idle_and_check(single), 1)


def test_a_dead_rank_stops_the_server_and_every_process(models: dict[str, Path]) -> None:
    server = _start(models["llama"], 2)
    pids = server.child_pids()
    os.kill(pids["scheduler-tp1"], signal.SIGKILL)
    server.proc.wait(60)
    assert server.proc.returncode == 1, server.log()[-3000:]
    assert "scheduler-tp1 process died" in server.log()
    assert wait_until(lambda: not any(pid_alive(p) for p in pids.values()), 15), pids
    server.log_path.unlink()


@pytest.mark.slow  # ~15 s more; the everyday suite covers the one-node wiring
def test_two_simulated_nodes(models: dict[str, Path]) -> None:
    """Node 1 runs only its scheduler rank (the same command, --node-rank 1); node 0 serves.
    Stopping node 0 releases node 1, which then exits cleanly by itself."""
    from minisgl import LLM, SamplingParams
    from tests.e2e.server_utils import free_port

    path = models["llama"]
    greedy = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    llm = LLM(str(path))
    word = _stop_word(
        llm.generate(STOP_PROMPT, SamplingParams(temperature=0, max_tokens=4))[0]["text"]
    )
    greedy.append(SamplingParams(temperature=0, max_tokens=12, stop=[word]))  # as _stopped
    expected = [
        (r["text"], r["finish_reason"]) for r in llm.generate([*PROMPTS, STOP_PROMPT], greedy)
    ]
    assert expected[-1][1] == "stop"
    del llm
    nodes = ["--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}"]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "minisgl", "--model", str(path), "--tp-size", "2", *OPTIONS,
         *nodes, "--node-rank", "1", "--log-level", "warning"],
        cwd=REPO, env=env.child_environ(SWITCHES),
    )  # fmt: skip
    try:
        node0 = _start(path, 2, *nodes, "--node-rank", "0")
        assert set(node0.child_pids()) == {"scheduler-tp0", "tokenizer"}
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda i: _complete(node0, i)[:2], range(len(PROMPTS))))
        assert [*got, _stopped(node0, word)] == expected
        _assert_ranks_clean(wait_idle_and_check(node0), 2)
        _stop_cleanly(node0)
        assert node1.wait(timeout=30) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


# ---------------------------------------------------------------- overlap scheduling


def _loop_rank(config: Any, args: Any) -> None:
    """Rank 1 of the loop-level test: the scheduler process's body, overlap forced on."""
    from minisgl.distributed import TPInfo
    from minisgl.distributed.group import destroy_tp_group
    from minisgl.engine.engine import Engine
    from minisgl.server.scheduler_process import SchedulerLoop

    loop = SchedulerLoop(Engine(config, TPInfo(1, 2)), args)
    loop.scheduler.overlap = True
    loop.run()
    destroy_tp_group()  # leave gloo before exiting, as run_scheduler's ranks do


@pytest.fixture
def short_dist_timeout() -> Iterator[None]:
    with env.override(SWITCHES):
        yield


def test_overlap_scheduling_keeps_the_ranks_in_step(
    models: dict[str, Path], tmp_path: Path, short_dist_timeout: None
) -> None:
    import multiprocessing as mp

    from minisgl import LLM, SamplingParams
    from minisgl.config import EngineConfig
    from minisgl.distributed import TPInfo
    from minisgl.distributed.group import destroy_tp_group
    from minisgl.distributed.topology import free_port
    from minisgl.engine.engine import Engine
    from minisgl.ipc import sockets
    from minisgl.ipc.messages import AbortRequests
    from minisgl.server.scheduler_process import SchedulerArgs, SchedulerLoop
    from tests.e2e.scheduler_harness import Harness

    path = str(models["llama_kv1"])
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    expected = [r["token_ids"] for r in LLM(path).generate(PROMPTS, greedy)]

    config = EngineConfig(
        model=path, tp_size=2, chunked_prefill_size=16, dist_init_addr=f"127.0.0.1:{free_port()}"
    )
    args = SchedulerArgs(
        config, sockets.IpcAddresses.in_dir(tmp_path), str(tmp_path / "tok"), os.getpid()
    )
    rank1 = mp.get_context("spawn").Process(target=_loop_rank, args=(config, args), daemon=True)
    rank1.start()
    thread = None
    try:
        # Rank 0 runs in this process's thread: its "parent" is this process's parent (with
        # our own pid it would think its parent gone and leave the loop when idle).
        rank0_args = dataclasses.replace(args, parent_pid=os.getppid())
        loop = SchedulerLoop(Engine(config, TPInfo(0, 2)), rank0_args)
        loop.scheduler.overlap = True
        harness = Harness(loop, args.addresses)
        thread = threading.Thread(target=loop.run, daemon=True)
        thread.start()
        harness.add(*[(i, p, {"max_tokens": n, "temperature": 0, "ignore_eos": True})
                      for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS))])  # fmt: skip
        harness.add((99, [30, 31, 32], {"max_tokens": 400, "ignore_eos": True}))
        harness.pump(lambda: all(harness.finished(i) for i in range(len(PROMPTS))), 120)
        got = [[t for o in harness.outputs[i] for t in o.new_ids] for i in range(len(PROMPTS))]
        assert got == expected
        sockets.send(harness.to_scheduler, AbortRequests([99]))  # mid-decode, batch in flight
        harness.pump(lambda: harness.finished(99), 60)
        assert harness.outputs[99][-1].finish_reason == "abort"
        reply = harness.control("integrity")
        assert reply.ok, reply.data
        _assert_ranks_clean(reply.data, 2)
        loop.stop()  # rank 0 leaves its loop and releases rank 1
        thread.join(30)
        rank1.join(30)
        assert rank1.exitcode == 0
        harness.ctx.destroy(linger=0)
    finally:
        if thread is not None and thread.is_alive():
            loop.stop()
        if rank1.is_alive():
            rank1.kill()
        destroy_tp_group()
