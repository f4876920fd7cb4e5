"""The OpenAI-compatible API, driven by the official openai client, against the default model
(SmolLM2-135M-Instruct on CPU) in a real server process. Every response and chunk is
re-validated against the client's own pydantic types."""

from __future__ import annotations

from collections import Counter
from typing import Any

import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.e2e.server_utils import QUESTION, ServerHandle, wait_idle_and_check

MODEL = "smollm2"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(default_server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=default_server.url("/v1"), api_key="none", max_retries=0, timeout=300
    )


def chat_prompt_tokens(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return len(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)


def check_stream_finishes(chunks: list[Any], n: int) -> None:
    """Exactly one finish_reason per choice index, and it is a known reason."""
    finishes = Counter(c.index for ch in chunks for c in ch.choices if c.finish_reason is not None)
    assert finishes == Counter(range(n)), finishes
    reasons = {c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason}
    assert reasons <= {"stop", "length"}, reasons


def test_launch_to_first_answer(
    default_server: ServerHandle, capsys: pytest.CaptureFixture[str]
) -> None:
    notes = default_server.notes
    with capsys.disabled():
        print(
            f"\n[minisgl e2e] default model on CPU: launch -> ready {notes['ready_s']:.1f}s, "
            f"launch -> first answer {notes['first_answer_s']:.1f}s ({notes['first_answer']!r})"
        )
    assert "Paris" in notes["first_answer"]


def test_models_list_and_retrieve(client: openai.OpenAI) -> None:
    models = list(client.models.list())
    assert [m.id for m in models] == [MODEL]
    Model.model_validate(models[0].model_dump())
    assert isinstance(models[0].model_extra["max_model_len"], int)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_non_stream(
    client: openai.OpenAI, tokenizer: Any, default_server: ServerHandle
) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=0
    )
    ChatCompletion.model_validate(resp.model_dump())
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == default_server.notes["first_answer"]  # greedy is repeatable
    assert "<|im_end|>" not in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = resp.usage
    assert usage is not None
    assert usage.prompt_tokens == chat_prompt_tokens(tokenizer, QUESTION)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 < usage.completion_tokens <= 8
    # The same prompt was served before, so most of it comes from the prefix cache.
    assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


def test_chat_stream_with_usage(
    client: openai.OpenAI, tokenizer: Any, default_server: ServerHandle
) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    for ch in chunks:
        ChatCompletionChunk.model_validate(ch.model_dump())
        assert ch.object == "chat.completion.chunk" and ch.model == MODEL
    assert len({ch.id for ch in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    body, last = chunks[:-1], chunks[-1]
    check_stream_finishes(body, 1)
    assert last.choices == [] and last.usage is not None
    assert all(ch.usage is None for ch in body)
    text = "".join(c.delta.content or "" for ch in body for c in ch.choices)
    assert text == default_server.notes["first_answer"]  # streamed == non-streamed
    assert last.usage.prompt_tokens == chat_prompt_tokens(tokenizer, QUESTION)
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


def test_continuous_usage_stats(client: openai.OpenAI, tokenizer: Any) -> None:
    """vLLM's continuous_usage_stats: every chunk carries the usage so far; completion tokens
    never go down and end at the final usage chunk's count."""
    prompt_tokens = chat_prompt_tokens(tokenizer, QUESTION)
    for create in (client.chat.completions.create, client.completions.create):
        kwargs: dict[str, Any] = (
            {"messages": QUESTION}
            if create == client.chat.completions.create
            else {"prompt": PROMPT}
        )
        stream = create(
            model=MODEL, max_tokens=8, temperature=0, stream=True, **kwargs,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )  # fmt: skip
        chunks = list(stream)
        assert all(ch.usage is not None for ch in chunks)
        counts = [ch.usage.completion_tokens for ch in chunks]  # type: ignore[union-attr]
        assert counts == sorted(counts) and counts[-1] > 0
        final = chunks[-1].usage
        assert chunks[-1].choices == [] and final is not None
        assert max(counts[:-1]) == final.completion_tokens
        if "messages" in kwargs:
            assert all(ch.usage.prompt_tokens == prompt_tokens for ch in chunks)  # type: ignore[union-attr]
        assert all(
            ch.usage.total_tokens == ch.usage.prompt_tokens + ch.usage.completion_tokens
            for ch in chunks
        )  # type: ignore[union-attr]


def test_completions_prompt_forms_and_echo(client: openai.OpenAI, tokenizer: Any) -> None:
    ids = tokenizer.encode(PROMPT)
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    Completion.model_validate(resp.model_dump())
    assert resp.object == "text_completion" and resp.choices[0].text
    assert resp.usage.prompt_tokens == len(ids)
    # Two token-id prompts with echo: both choices, prompt-major order, prompts counted once each.
    other = tokenizer.encode("Hello, my name is")
    resp = client.completions.create(
        model=MODEL, prompt=[ids, other], max_tokens=3, temperature=0, echo=True
    )
    Completion.model_validate(resp.model_dump())
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.choices[0].text.startswith(PROMPT)
    assert resp.choices[1].text.startswith("Hello, my name is")
    assert resp.usage.prompt_tokens == len(ids) + len(other)


def test_completions_echo_scores_the_prompt(client: openai.OpenAI, tokenizer: Any) -> None:
    """echo + logprobs: every prompt token but the first gets its logprob and alternatives."""
    ids = tokenizer.encode(PROMPT)
    resp = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=2
    )
    # Not validated with the client's types: like vLLM and the legacy API, the first prompt
    # token's logprob is null (nothing precedes it), which those types do not allow.
    lp = resp.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(ids) + 2
    assert lp.token_logprobs[0] is None
    prompt_lps = lp.token_logprobs[1 : len(ids)]
    assert all(v is not None and v <= 0 for v in prompt_lps)
    for v, top in zip(prompt_lps, lp.top_logprobs[1 : len(ids)]):
        assert top is not None and 1 <= len(top) <= 2 and max(top.values()) >= v - 1e-4
    again = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=0
    )
    assert again.choices[0].logprobs.token_logprobs[1 : len(ids)] == pytest.approx(
        prompt_lps, abs=1e-4
    )


def test_completions_stream_with_usage(client: openai.OpenAI, tokenizer: Any) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    for ch in chunks:
        dumped = ch.model_dump()
        for c in dumped["choices"]:
            # The client reuses the non-streaming type, whose finish_reason may not be null;
            # mid-stream chunks carry null there (as OpenAI's own stream does).
            c["finish_reason"] = c["finish_reason"] or "length"
        Completion.model_validate(dumped)
        assert ch.object == "text_completion"
    check_stream_finishes(chunks[:-1], 1)
    assert "".join(c.text for ch in chunks[:-1] for c in ch.choices) == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(
        tokenizer.encode(PROMPT)
    )


def test_n_choices(client: openai.OpenAI, tokenizer: Any) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=6, temperature=0.8, n=2
    )
    ChatCompletion.model_validate(resp.model_dump())
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert resp.usage.prompt_tokens == chat_prompt_tokens(tokenizer, QUESTION)  # counted once
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=6, temperature=0.8, n=2, stream=True
        )
    )
    check_stream_finishes(chunks, 2)
    roles = [c.index for ch in chunks for c in ch.choices if c.delta.role == "assistant"]
    assert sorted(roles) == [0, 1]


def test_completions_prompt_list_with_n(client: openai.OpenAI, tokenizer: Any) -> None:
    """prompt=[a, b], n=2: four choices, index = prompt_index * n + j (OpenAI's and vLLM's
    order), one finish_reason each; usage counts each prompt once (not once per choice, as
    vLLM) and sums the four completions. Streamed and not."""
    other = "Hello, my name is"
    kwargs: dict[str, Any] = dict(
        model=MODEL, prompt=[PROMPT, other], n=2, max_tokens=3, temperature=0,
        echo=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    prompt_tokens = len(tokenizer.encode(PROMPT)) + len(tokenizer.encode(other))
    resp = client.completions.create(**kwargs)
    Completion.model_validate(resp.model_dump())
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [c.text.startswith(PROMPT) for c in resp.choices] == [True, True, False, False]
    assert [c.text.startswith(other) for c in resp.choices] == [False, False, True, True]
    assert [c.finish_reason for c in resp.choices] == ["length"] * 4
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == prompt_tokens
    assert resp.usage.completion_tokens == 4 * 3
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    check_stream_finishes(chunks[:-1], 4)
    texts = ["", "", "", ""]
    for ch in chunks[:-1]:
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in resp.choices]  # greedy: the same choices, in order
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, 12)


def _stop_across_tokens(client: openai.OpenAI, tokenizer: Any) -> tuple[str, str]:
    """A greedy completion and a stop string that straddles a token boundary in it."""
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    text = base.choices[0].text
    ids = tokenizer.encode(text, add_special_tokens=False)
    for k in range(len(ids) // 2, len(ids)):
        cut = len(tokenizer.decode(ids[:k]))
        stop = text[cut - 2 : cut + 2]
        if len(stop) == 4 and text.find(stop) == cut - 2:
            return text, stop
    pytest.skip(f"no usable stop string in {text!r}")


def test_stop_string_across_chunks(client: openai.OpenAI, tokenizer: Any) -> None:
    text, stop = _stop_across_tokens(client, tokenizer)
    expected = text[: text.find(stop)]
    resp = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop, "zzzz"]
    )
    assert resp.choices[0].text == expected
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].model_extra["matched_stop"] == stop
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop, stream=True
        )
    )
    pieces = [c.text for ch in chunks for c in ch.choices]
    assert "".join(pieces) == expected  # nothing of the stop string ever leaked
    check_stream_finishes(chunks, 1)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_logprobs(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    ChatCompletion.model_validate(resp.model_dump())
    content = resp.choices[0].logprobs.content
    assert content and len(content) <= 5
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.logprob <= 0
        tops = [t.logprob for t in item.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert item.top_logprobs[0].token == item.token
        assert abs(item.top_logprobs[0].logprob - item.logprob) < 1e-4
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=3, temperature=0, logprobs=True,
            top_logprobs=3, stream=True,
        )
    )  # fmt: skip
    streamed = [i for ch in chunks for c in ch.choices if c.logprobs for i in c.logprobs.content]
    assert streamed and all(len(i.top_logprobs) == 3 for i in streamed)


def test_completion_logprobs(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3
    )
    lp = resp.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert all(x is not None and x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)


def _streamed_logprobs(chunks: list[Any]) -> dict[str, list[Any]]:
    """Every choice-0 logprobs field of a completions stream, concatenated in order."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}  # fmt: skip
    for ch in chunks:
        for c in ch.choices:
            if c.logprobs is not None:
                for key, values in out.items():
                    values += getattr(c.logprobs, key)
    return out


@pytest.mark.parametrize("echo", [False, True])
def test_completion_logprobs_streamed_as_whole(
    client: openai.OpenAI, tokenizer: Any, echo: bool
) -> None:
    """Streamed logprobs=2: one entry per completion token (usage's count; with echo, the
    prompt's tokens first), the same tokens, logprobs, alternatives and text_offset as the
    non-streamed response. text_offset is where a token starts in the choice's ``text``
    (with echo the prompt's text comes first), as vLLM counts it: OpenAI's legacy API counted
    from the start of the prompt even without echo, which indexes no text the client gets.
    A stop string that begins like the completion but never matches holds the streamed text
    back: the offsets must still follow the tokens, not the text sent so far."""
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    first = tokenizer.decode(tokenizer.encode(plain.choices[0].text)[:1])
    stop = plain.choices[0].text[: len(first) + 1] + "\u2603"  # held back, never matched
    kwargs: dict[str, Any] = dict(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, seed=5, logprobs=2,
        echo=echo, stop=[stop],
    )  # fmt: skip
    full = client.completions.create(**kwargs)
    choice = full.choices[0]
    assert choice.logprobs is not None and full.usage is not None
    whole = {k: list(getattr(choice.logprobs, k)) for k in _streamed_logprobs([]).keys()}
    prompt_tokens = full.usage.prompt_tokens if echo else 0
    assert len(whole["tokens"]) == prompt_tokens + full.usage.completion_tokens
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    streamed = _streamed_logprobs(chunks)
    assert chunks[-1].usage is not None
    assert len(streamed["tokens"]) == prompt_tokens + chunks[-1].usage.completion_tokens
    assert "".join(c.text for ch in chunks for c in ch.choices) == choice.text
    assert streamed["tokens"] == whole["tokens"]
    assert streamed["text_offset"] == whole["text_offset"]
    assert streamed["token_logprobs"] == pytest.approx(whole["token_logprobs"], abs=1e-4)
    assert [t and set(t) for t in streamed["top_logprobs"]] == [
        t and set(t) for t in whole["top_logprobs"]
    ]
    # Offsets: from 0, increasing, each token's text found at its offset in the choice's text.
    offsets, tokens, text = whole["text_offset"], whole["tokens"], choice.text
    assert offsets[0] == 0
    assert all(b == a + len(t) for a, b, t in zip(offsets, offsets[1:], tokens))
    assert all(b > a for a, b, t in zip(offsets, offsets[1:], tokens) if t)
    for off, tok in zip(offsets, tokens):
        if off + len(tok) <= len(text):
            assert text[off : off + len(tok)] == tok, (off, tok, text)


def test_seed_reproducible(client: openai.OpenAI) -> None:
    def ask() -> str:
        r = client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=8, temperature=0.8, seed=1234
        )
        return r.choices[0].message.content or ""

    assert ask() == ask()


def test_max_completion_tokens_and_extras(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_completion_tokens=3, temperature=0.7,
        presence_penalty=0.5, frequency_penalty=0.5,
        extra_body={"ignore_eos": True, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    )  # fmt: skip
    assert resp.usage.completion_tokens == 3
    assert resp.choices[0].finish_reason == "length"


def test_chat_template_options(client: openai.OpenAI, tokenizer: Any) -> None:
    """vLLM/SGLang chat extensions: continue_final_message renders the assistant's draft
    open (as transformers does), chat_template_kwargs reach the template, and a kwarg that
    would override the renderer's own is a 400 naming the field."""
    draft = [*QUESTION, {"role": "assistant", "content": "The capital is"}]
    want = tokenizer.apply_chat_template(
        draft, continue_final_message=True, add_generation_prompt=False, tokenize=True
    )
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "input_ids") else want
    resp = client.chat.completions.create(
        model=MODEL, messages=draft, max_tokens=2, temperature=0,
        extra_body={"continue_final_message": True, "chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    assert resp.usage.prompt_tokens == len(want)
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=2,
            extra_body={"chat_template_kwargs": {"tokenize": False}},
        )  # fmt: skip


def test_metrics(default_server: ServerHandle) -> None:
    status, text = default_server.get("/metrics")
    assert status == 200
    for name in (
        "minisgl_num_running_reqs", "minisgl_num_waiting_reqs", "minisgl_kv_cache_usage",
        "minisgl_prefix_cache_hit_rate", "minisgl_time_to_first_token_seconds_bucket",
        "minisgl_inter_token_latency_seconds_bucket", "minisgl_generation_tokens_total",
    ):  # fmt: skip
        assert name in text, name
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values["minisgl_generation_tokens_total"] > 0
    assert values["minisgl_time_to_first_token_seconds_count"] > 0
    # Every request that got a first token waited some (non-negative) time in the queue.
    queued = values["minisgl_queue_time_seconds_count"]
    assert queued == values["minisgl_time_to_first_token_seconds_count"]
    assert (
        0
        <= values["minisgl_queue_time_seconds_sum"]
        <= values["minisgl_time_to_first_token_seconds_sum"]
    )
    assert 0 < values["minisgl_prefix_cache_hit_rate"] <= 1


def test_zz_nothing_leaked(default_server: ServerHandle) -> None:
    wait_idle_and_check(default_server)
