"""API fuzzing. Two generators, one server:

1. schemathesis, from the server's own OpenAPI schema: valid (positive) and schema-violating
   (negative) requests for every route.
2. hypothesis bodies for the three generation routes that are *nearly* valid: real prompts
   and sampling values in and around their ranges (the schema is deliberately loose, value
   ranges are SamplingParams' job, so schemathesis alone rarely gets past validation).

Whatever arrives, the server answers without a 5xx, every error is an OpenAI-style error
object, every 200 stream is well framed and carries no error event, and afterwards the server
is alive, idle, and has leaked nothing. The tiny random model with a 32-token context keeps
valid generations cheap (a fuzzed n=128 without max_tokens asks for 128 x 31 tokens at most).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.server_utils import (
    ServerHandle,
    assert_clean_log,
    call,
    check_idle,
    metric,
    sse_events,
    start_server,
)

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")
requests = pytest.importorskip("requests")
st = hypothesis.strategies

pytestmark = pytest.mark.slow

KEY = "fuzz-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 32
# Examples per (operation, mode). Routes without parameters have one possible request, so
# hypothesis stops after it; the three generation routes make up the bulk.
SCHEMA_EXAMPLES = 200
NEAR_VALID_EXAMPLES = 100  # per generation route
MIN_REQUESTS = 1000
REQUEST_TIMEOUT_S = 120  # a hang is as much a failure as a 5xx

Statuses = Counter[tuple[str, int]]


@pytest.fixture(scope="module")
def fuzz_server(tiny_model: Path) -> Iterator[ServerHandle]:
    server = start_server(
        ["--model", str(tiny_model), "--context-length", str(CONTEXT), "--api-key", KEY]
    )
    yield server
    assert server.stop() == 0, server.log()[-3000:]
    assert KEY not in server.log(), "the API key leaked into the log"
    assert_clean_log(server)


def _settings(examples: int) -> Any:
    from hypothesis import HealthCheck, Phase, settings

    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,  # the same requests on every run: a failure reproduces
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )


def _check(label: str, response: Any) -> None:
    status = response.status_code
    ctype = response.headers.get("content-type") or ""
    if isinstance(ctype, list):  # schemathesis' responses hold a list per header
        ctype = ctype[0] if ctype else ""
    if ctype.startswith("text/event-stream"):
        assert status == 200, (label, status)
        assert not getattr(response, "stream_cut_short", False), "the fuzzer cut the stream"
        events = sse_events(response.text)  # asserts the framing
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert not errors, f"{label}: error event in a 200 stream: {errors}"
        return
    try:
        body = response.json()
    except ValueError:
        body = response.text
    assert status < 500, f"{label}: {status} {str(body)[:500]}"
    if status >= 400:
        # Every refusal is an OpenAI-style error, never FastAPI's or Starlette's default shape.
        assert isinstance(body, dict) and isinstance(body.get("error"), dict), (label, body)
        err = body["error"]
        assert isinstance(err.get("message"), str) and err.get("code") == status, (label, body)


# ---------------------------------------------------------------- 1. from the schema
def _fuzz_operation(op: Any, mode: Any, server: ServerHandle, statuses: Statuses) -> None:
    from hypothesis import given

    @_settings(SCHEMA_EXAMPLES)
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        response = case.call(base_url=server.base_url, headers=AUTH, timeout=REQUEST_TIMEOUT_S)
        statuses[(op.label, response.status_code)] += 1
        _check(op.label, response)

    try:
        run()
    except hypothesis.errors.Unsatisfiable:
        pass  # no negative request exists for a route without parameters or body


# ---------------------------------------------------------------- 2. nearly valid bodies
def _maybe(strategy: Any) -> Any:
    return st.one_of(st.none(), strategy)


WORDS = st.lists(st.integers(0, 260).map(lambda i: f"t{i}"), max_size=12).map(" ".join)
IDS = st.lists(st.integers(0, 255), max_size=12)
# Values in range and on its edges (schemathesis already covers the values outside).
SAMPLING = {
    "temperature": st.sampled_from([0, 0.0001, 0.7, 1.0, 2.0]),
    "top_p": st.sampled_from([1e-6, 0.5, 1.0]),
    "top_k": st.sampled_from([-1, 1, 3, 10_000]),
    "min_p": st.sampled_from([0.0, 0.2, 1.0]),
    "presence_penalty": st.sampled_from([-2.0, 0.0, 1.5, 2.0]),
    "frequency_penalty": st.sampled_from([-2.0, 0.0, 1.0]),
    "repetition_penalty": st.sampled_from([0.5, 1.0, 1.3]),
    "stop": st.one_of(WORDS, st.lists(WORDS, max_size=5)),
    "stop_token_ids": st.lists(st.integers(0, 255), max_size=3),
    "ignore_eos": st.booleans(),
    "seed": st.integers(-(2**62), 2**62),
}
OPENAI_EXTRA = {
    "n": st.integers(1, 4),
    "max_tokens": _maybe(st.integers(0, 24)),
    "min_tokens": st.integers(0, 4),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
}
CONTENT = st.one_of(
    WORDS, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": WORDS}), max_size=3)
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool"])},
    optional={"content": CONTENT, "name": WORDS},
)
CHAT = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, max_size=4)},
    optional={
        **SAMPLING, **OPENAI_EXTRA,
        "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
        "max_completion_tokens": st.integers(0, 24),
    },
)  # fmt: skip
COMPLETION = st.fixed_dictionaries(
    {"prompt": st.one_of(WORDS, IDS, st.lists(WORDS, max_size=3), st.lists(IDS, max_size=3))},
    optional={**SAMPLING, **OPENAI_EXTRA, "echo": st.booleans(), "logprobs": st.integers(0, 5)},
)
NATIVE_SAMPLING = st.fixed_dictionaries(
    # max_new_tokens defaults to 128, more than the context: always say how many.
    {"max_new_tokens": _maybe(st.integers(0, 24))},
    optional={
        **{k: v for k, v in SAMPLING.items() if k != "seed"},
        "min_new_tokens": st.integers(0, 4),
        "n": st.integers(1, 4),
        "sampling_seed": st.integers(-(2**62), 2**62),
    },
)
GENERATE_OPTIONS = {
    "stream": st.booleans(),
    "return_logprob": st.booleans(),
    "top_logprobs_num": st.integers(0, 5),
    "rid": WORDS,
}
GENERATE = st.one_of(
    st.fixed_dictionaries(
        {"sampling_params": NATIVE_SAMPLING, "text": st.one_of(WORDS, st.lists(WORDS, max_size=3))},
        optional=GENERATE_OPTIONS,
    ),
    st.fixed_dictionaries(
        {
            "sampling_params": NATIVE_SAMPLING,
            "input_ids": st.one_of(IDS, st.lists(IDS, max_size=3)),
        },
        optional=GENERATE_OPTIONS,
    ),
)
NEAR_VALID = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION, "/generate": GENERATE}


def _fuzz_near_valid(path: str, server: ServerHandle, statuses: Statuses) -> None:
    from hypothesis import given

    label = f"near-valid POST {path}"
    session = requests.Session()

    @_settings(NEAR_VALID_EXAMPLES)
    @given(body=NEAR_VALID[path])
    def run(body: dict[str, Any]) -> None:
        response = session.post(
            server.url(path), json=body, headers=AUTH, timeout=REQUEST_TIMEOUT_S
        )
        statuses[(label, response.status_code)] += 1
        _check(label, response)

    run()


# ---------------------------------------------------------------- the test
def test_fuzz_every_route(fuzz_server: ServerHandle) -> None:
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(fuzz_server.url("/openapi.json"), headers=AUTH)
    # schemathesis reads 20 events of a stream by default; the checks need every stream whole.
    schema.config.max_stream_events = 1_000_000
    statuses: Statuses = Counter()
    started = time.monotonic()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 11, [op.label for op in operations]
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz_operation(op, mode, fuzz_server, statuses)
    for path in NEAR_VALID:
        _fuzz_near_valid(path, fuzz_server, statuses)

    total = sum(statuses.values())
    by_status: Counter[int] = Counter()
    for (_, status), count in statuses.items():
        by_status[status] += count
    summary = {
        "requests": total,
        "by_status": dict(sorted(by_status.items())),
        "seconds": round(time.monotonic() - started, 1),
    }
    print(f"\nfuzz: {summary}")
    for (label, status), count in sorted(statuses.items()):
        print(f"  {label:45s} {status} x{count}")
    assert total >= MIN_REQUESTS, statuses
    assert by_status[200] >= 100, "too few valid requests to exercise the engine"

    # Alive, idle, nothing leaked, and a normal request is still answered normally.
    assert fuzz_server.get("/health")[0] == 200
    check_idle(fuzz_server, AUTH)
    status, body = call(
        fuzz_server, "POST", "/v1/completions",
        {"prompt": "t5 t6", "max_tokens": 4, "temperature": 0}, headers=AUTH,
    )  # fmt: skip
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    assert metric(fuzz_server, "minisgl_integrity_checks_total", AUTH) >= 1
    assert metric(fuzz_server, "minisgl_integrity_violations_total", AUTH) == 0
