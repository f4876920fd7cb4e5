"""stop_regex through a real server process, driven by the official openai client: completions
and chat, streamed and not, n > 1, the native /generate, and the 400 for a bad pattern.

The tiny model's tokenizer is word-level (tokens decode to words "t3", "t4", ...), so a pattern
over its greedy output is predictable: the expected output is found token by token with the
standard library's ``re``, independently of the server's matcher."""

from __future__ import annotations

import re
from typing import Any

import openai
import pytest

from tests.e2e.server_utils import ServerHandle, wait_idle_and_check

MODEL = "tiny"
PROMPT = "t5 t6 t7"
MESSAGES = [{"role": "user", "content": "t9 t10 t11"}]
MAX = 24
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": MAX}
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(tiny_server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=tiny_server.url("/v1"), api_key="none", max_retries=0, timeout=120
    )


def _later_words(text: str) -> str:
    words = text.split(" ")
    assert len(words) == MAX, text  # one word per token
    return rf"(?<!\S){words[6]} {words[7]}(?!\S)"  # two whole words: spans two tokens


def _expected(text: str, pattern: str) -> tuple[str, int]:
    """The text before the match in the shortest run of tokens whose text holds one, and how
    many tokens that is."""
    words = text.split(" ")
    for k in range(1, len(words) + 1):
        prefix = " ".join(words[:k])
        m = re.search(pattern, prefix)
        if m is not None:
            return prefix[: m.start()], k
    raise AssertionError(f"{pattern!r} never matches {text!r}")


def _scheduler_aborts(server: ServerHandle) -> float:
    """Sequences the scheduler was told to abort; the detokenizer's safety net for a match the
    scheduler missed is one, so it stays put when the scheduler itself ends at the match."""
    _, text = server.get("/metrics")
    name = "minisgl_scheduler_aborts_total"
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def _bad_request(call: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    body = info.value.response.json()
    assert info.value.status_code == 400
    return dict(body["error"])


def test_completions(client: openai.OpenAI, tiny_server: ServerHandle) -> None:
    base = client.completions.create(model=MODEL, prompt=PROMPT, extra_body=NO_EOS, **GREEDY)
    text = base.choices[0].text
    pattern = _later_words(text)
    expected, tokens = _expected(text, pattern)
    assert tokens < MAX
    aborts = _scheduler_aborts(tiny_server)
    extra = {**NO_EOS, "stop_regex": pattern}
    resp = client.completions.create(model=MODEL, prompt=PROMPT, extra_body=extra, **GREEDY)
    choice = resp.choices[0]
    assert choice.text == expected
    assert choice.finish_reason == "stop"
    assert choice.model_extra["matched_stop"] == pattern
    assert resp.usage is not None and resp.usage.completion_tokens == tokens  # no token past it
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, extra_body=extra, stream=True,
            stream_options={"include_usage": True}, **GREEDY,
        )
    )  # fmt: skip
    # Streamed text is only ever appended to: equal at the end means nothing leaked before.
    assert "".join(c.text for ch in chunks for c in ch.choices) == expected
    finishes = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == tokens
    wait_idle_and_check(tiny_server)
    assert _scheduler_aborts(tiny_server) == aborts


def test_held_back_text_comes_out_when_the_match_never_completes(client: openai.OpenAI) -> None:
    base = client.completions.create(model=MODEL, prompt=PROMPT, extra_body=NO_EOS, **GREEDY)
    text = base.choices[0].text
    # Begins at the first word, and could go on matching until the end: all held back.
    pattern = rf"{text.split(' ')[0]}(?: t\d+)* zzz"
    extra = {**NO_EOS, "stop_regex": [pattern]}
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, extra_body=extra, stream=True, **GREEDY
        )
    )
    pieces = [c.text for ch in chunks for c in ch.choices if c.text]
    assert "".join(pieces) == text and len(pieces) == 1  # released once, at the end
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_streamed_and_not_with_n(client: openai.OpenAI, tiny_server: ServerHandle) -> None:
    base = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, extra_body=NO_EOS, **GREEDY
    )
    content = base.choices[0].message.content or ""
    pattern = _later_words(content)
    expected, tokens = _expected(content, pattern)
    aborts = _scheduler_aborts(tiny_server)
    extra = {**NO_EOS, "stop_regex": ["zzz+", pattern]}
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=2, extra_body=extra, **GREEDY
    )
    assert [c.message.content for c in resp.choices] == [expected, expected]
    assert [c.finish_reason for c in resp.choices] == ["stop", "stop"]
    assert all(c.model_extra["matched_stop"] == pattern for c in resp.choices)
    assert resp.usage is not None and resp.usage.completion_tokens == 2 * tokens
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, n=2, extra_body=extra, stream=True, **GREEDY
        )
    )
    for index in (0, 1):
        mine = [c for ch in chunks for c in ch.choices if c.index == index]
        assert "".join(c.delta.content or "" for c in mine) == expected
        assert [c.finish_reason for c in mine if c.finish_reason] == ["stop"]
    wait_idle_and_check(tiny_server)
    assert _scheduler_aborts(tiny_server) == aborts


def test_native_generate(tiny_server: ServerHandle) -> None:
    params = {"temperature": 0, "max_new_tokens": MAX, "ignore_eos": True}
    status, base = tiny_server.post("/generate", {"text": PROMPT, "sampling_params": params})
    assert status == 200, base
    pattern = _later_words(base["text"])
    expected, tokens = _expected(base["text"], pattern)
    body = {"text": PROMPT, "sampling_params": {**params, "stop_regex": pattern}}
    status, out = tiny_server.post("/generate", body)
    assert status == 200, out
    assert out["text"] == expected and len(out["output_ids"]) == tokens
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    status, err = tiny_server.post(
        "/generate", {"text": PROMPT, "sampling_params": {**params, "stop_regex": "t5("}}
    )
    assert status == 400 and err["error"]["param"] == "stop_regex", err


def test_bad_pattern_is_a_400_and_the_server_keeps_serving(
    client: openai.OpenAI, tiny_server: ServerHandle
) -> None:
    for stream in (False, True):
        err = _bad_request(
            lambda s=stream: client.completions.create(
                model=MODEL, prompt=PROMPT, stream=s, extra_body={"stop_regex": ["ok", "[t5"]},
                **GREEDY,
            )
        )  # fmt: skip
        assert err["param"] == "stop_regex" and err["type"] == "invalid_request_error"
        assert err["code"] == 400 and "[t5" in err["message"]
    err = _bad_request(
        lambda: client.chat.completions.create(
            model=MODEL, messages=MESSAGES, extra_body={"stop_regex": r"\s*"}, **GREEDY
        )
    )
    assert err["param"] == "stop_regex" and "empty" in err["message"]
    # Still serving, with nothing left behind (no live request, every KV page free).
    ok = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")
    wait_idle_and_check(tiny_server)
