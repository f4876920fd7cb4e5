"""``python -m minisgl --dp-size 2``: two replicas of the default model behind SGLang's
router, with an API key. Through the router the official openai client and /generate get
the greedy outputs of one server; the router names the served model, flushes every replica,
and routes conversations to the replica that holds their prefix (cache_aware); each replica
keeps its /metrics and the router exports its own; SIGTERM leaves no process behind."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from tests.e2e.server_utils import (
    QUESTION,
    ServerHandle,
    assert_clean_log,
    call,
    free_port,
    http,
    pid_alive,
    process_tree,
    start_dp_server,
    wait_until,
)

pytest.importorskip("sglang_router")

MODEL = "smollm2"
KEY = "dp-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ASK: Any = QUESTION  # the openai client's message type
METRICS_PORT = free_port()
# Balance thresholds pinned so high that the router never trades cache affinity for load
# balance: the cache-aware outcome must not depend on how busy the machine is.
PINNED = "--balance-abs-threshold 100000 --balance-rel-threshold 1000 --cache-threshold 0.3"


@pytest.fixture(scope="module")
def dp_server() -> Iterator[ServerHandle]:
    server = start_dp_server(
        ["--served-model-name", MODEL, "--router-prometheus-port", str(METRICS_PORT)]
        + ["--router-args", PINNED],
        replicas=2,
        key=KEY,
    )
    pids = process_tree(server.proc.pid)
    yield server
    assert server.stop(signal.SIGTERM) == 0, server.log()[-3000:]
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), 10), server.log()[-3000:]
    assert KEY not in server.log(), "the API key leaked into the log"
    assert_clean_log(server)


@pytest.fixture(scope="module")
def client(dp_server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=dp_server.url("/v1"), api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def one_server(default_server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=default_server.url("/v1"), api_key="none", max_retries=0)


def replica_urls(dp_server: ServerHandle) -> list[str]:
    _, listed = call(dp_server, "GET", "/workers", headers=AUTH)
    return sorted(w["url"] for w in listed["workers"])


def test_router_names_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_clients_need_the_key(dp_server: ServerHandle) -> None:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 2}
    assert call(dp_server, "POST", "/v1/chat/completions", body)[0] == 401
    wrong = {"Authorization": "Bearer wrong"}
    assert call(dp_server, "POST", "/v1/chat/completions", body, headers=wrong)[0] == 401
    for url in replica_urls(dp_server):  # the replicas want it too
        assert http("GET", url + "/v1/models")[0] == 401


def choices(out: Any, stream: bool, text: Any) -> list[tuple[int, str, str, list[float]]]:
    """(index, text, finish_reason, token logprobs) of every choice, streamed or not."""
    got: dict[int, list[Any]] = {}
    for chunk in out if stream else [out]:
        for ch in chunk.choices:
            seen = got.setdefault(ch.index, ["", None, []])
            seen[0] += text(ch) or ""
            seen[1] = ch.finish_reason or seen[1]
            # Chat choices carry logprobs.content, completions logprobs.token_logprobs.
            lp = getattr(ch.logprobs, "content", None) or getattr(ch.logprobs, "token_logprobs", [])
            seen[2] += [round(t if isinstance(t, float) else t.logprob, 4) for t in lp or []]
    return sorted((i, *v) for i, v in got.items())


def assert_same_choices(got: list[tuple[int, str, str, list[float]]], want: list) -> None:
    """The same tokens, texts and finish reasons; logprobs within 2e-3. The default model's
    GGUF products quantize activations (int16 per 32 inputs), so a request whose prefix the
    other server had cached (or batched differently) can differ in the last digits."""
    assert [c[:3] for c in got] == [c[:3] for c in want]
    for g, w in zip(got, want, strict=True):
        assert len(g[3]) == len(w[3]) and all(abs(a - b) <= 2e-3 for a, b in zip(g[3], w[3]))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_one_server(
    client: openai.OpenAI, one_server: openai.OpenAI, stream: bool
) -> None:
    """n=2, logprobs and a stop string in one request: every choice as one server gives it."""

    def ask(c: openai.OpenAI) -> list[tuple[int, str, str, list[float]]]:
        out = c.chat.completions.create(
            model=MODEL, messages=ASK, temperature=0, max_tokens=12, n=2, stop=["."],
            logprobs=True, top_logprobs=2, stream=stream,
        )  # fmt: skip
        return choices(out, stream, lambda ch: ch.delta.content if stream else ch.message.content)

    routed = ask(client)
    assert_same_choices(routed, ask(one_server))
    assert [c[2] for c in routed] == ["stop", "stop"] and all(c[3] for c in routed), routed


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_one_server(
    client: openai.OpenAI, one_server: openai.OpenAI, stream: bool
) -> None:
    def ask(c: openai.OpenAI) -> list[tuple[int, str, str, list[float]]]:
        out = c.completions.create(
            model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8, n=2,
            logprobs=2, stop=["\n"], stream=stream,
        )  # fmt: skip
        return choices(out, stream, lambda ch: ch.text)

    routed = ask(client)
    assert_same_choices(routed, ask(one_server))
    assert all(c[3] for c in routed), routed


def test_generate_equals_one_server(dp_server: ServerHandle, default_server: ServerHandle) -> None:
    body = {
        "text": "The capital of France is",
        "sampling_params": {"max_new_tokens": 6, "temperature": 0},
    }
    status, routed = call(dp_server, "POST", "/generate", body, headers=AUTH)
    assert status == 200, routed
    assert routed["text"] == default_server.post("/generate", body)[1]["text"]


def test_flush_reaches_every_replica(dp_server: ServerHandle) -> None:
    status, flushed = call(dp_server, "POST", "/flush_cache", headers=AUTH)
    assert status == 200 and flushed["workers_flushed"] == 2, flushed


def test_metrics_of_replicas_and_router(dp_server: ServerHandle) -> None:
    for url in replica_urls(dp_server):
        status, text = call_url(url + "/metrics")
        assert status == 200 and "minisgl_" in text
    status, text = http("GET", f"http://127.0.0.1:{METRICS_PORT}/metrics")
    assert status == 200 and "smg_" in text, text[:500]


def call_url(url: str) -> tuple[int, Any]:
    import urllib.request

    req = urllib.request.Request(url, headers=AUTH)
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.status, resp.read().decode()


# ---------------------------------------------------------------- cache-aware routing
WORDS = (
    "river stone lantern orchard copper meadow harbor violet summit thunder willow ember "
    "glacier falcon marble canyon velvet prairie beacon cobalt saffron tundra quartz lagoon"
).split()


def system_prompt(conv: int) -> str:
    # Distinct from the first word on, so that no two conversations share a cached prefix;
    # about 250 tokens.
    words = [WORDS[(conv * 7 + i * (conv + 3)) % len(WORDS)] for i in range(170)]
    return f"Conversation {conv}. You are a terse assistant. Notes: " + " ".join(words)


def conversation(client: openai.OpenAI, conv: int) -> list[tuple[int, int]]:
    """4 turns, each the previous turn's messages plus the reply and a new question:
    (prompt_tokens, cached_tokens) of every turn."""
    messages: list[Any] = [{"role": "system", "content": system_prompt(conv)}]
    usage = []
    for turn in range(4):
        question = f"Question {turn}: " + " ".join(WORDS[turn : turn + 12]) + "?"
        messages.append({"role": "user", "content": question})
        out = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, temperature=0
        )
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        usage.append((out.usage.prompt_tokens, out.usage.prompt_tokens_details.cached_tokens or 0))
        messages.append({"role": "assistant", "content": out.choices[0].message.content})
    return usage


def run_conversations(client: openai.OpenAI, at_once: int) -> list[list[tuple[int, int]]]:
    """8 conversations, ``at_once`` of them at a time."""
    with ThreadPoolExecutor(at_once) as pool:
        return list(pool.map(lambda conv: conversation(client, conv), range(8)))


@pytest.fixture(scope="module")
def cache_aware_usage(
    client: openai.OpenAI, dp_server: ServerHandle
) -> list[list[tuple[int, int]]]:
    assert call(dp_server, "POST", "/flush_cache", headers=AUTH)[0] == 200
    return run_conversations(client, at_once=8)  # the thresholds make load irrelevant


def test_cache_aware_routing_reuses_each_conversations_prefix(
    cache_aware_usage: list[list[tuple[int, int]]],
) -> None:
    for conv in cache_aware_usage:
        assert conv[0][0] >= 200, conv  # the system prompt alone is 200+ tokens
        for prompt, cached in conv[1:]:
            assert cached >= 0.8 * prompt, cache_aware_usage


@pytest.mark.slow
def test_round_robin_reuses_less(
    dp_server: ServerHandle, cache_aware_usage: list[list[tuple[int, int]]]
) -> None:
    """Another router, round_robin, in front of the same replicas (caches flushed first)."""
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--policy", "round_robin", "--api-key", KEY, "--log-level", "warn"]
    cmd += ["--prometheus-port", str(free_port()), "--worker-urls", *replica_urls(dp_server)]
    assert call(dp_server, "POST", "/flush_cache", headers=AUTH)[0] == 200
    proc = subprocess.Popen(cmd)
    try:
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                return call_url(url + "/readiness")[0] == 200
            except OSError:
                return False

        assert wait_until(ready, 60)
        rr = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        # One at a time: round robin then alternates replicas turn by turn, deterministically.
        usage = run_conversations(rr, at_once=1)
    finally:
        proc.terminate()
        proc.wait(30)
    later = sum(cached for conv in usage for _, cached in conv[1:])
    aware = sum(cached for conv in cache_aware_usage for _, cached in conv[1:])
    assert later <= 0.7 * aware, (later, aware, usage)
