"""SGLang-native routes and error handling against the default model in a real server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.server_utils import QUESTION, ServerHandle, http, sse_events, wait_idle_and_check

PROMPT = "The capital of France is"
GOOD_CHAT = {"model": "smollm2", "messages": QUESTION, "max_tokens": 2, "temperature": 0}


def test_generate_non_stream(default_server: ServerHandle, tokenizer: Any) -> None:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    status, out = default_server.post("/generate", body)
    assert status == 200, out
    meta = out["meta_info"]
    assert out["text"] and len(out["output_ids"]) == meta["completion_tokens"] <= 6
    assert meta["prompt_tokens"] == len(tokenizer.encode(PROMPT))
    assert isinstance(meta["id"], str) and isinstance(meta["cached_tokens"], int)
    assert meta["finish_reason"]["type"] in ("stop", "length")
    # Token ids in, the same greedy continuation out.
    ids = tokenizer.encode(PROMPT)
    status, by_ids = default_server.post(
        "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    )
    assert status == 200 and by_ids["text"] == out["text"]
    assert by_ids["meta_info"]["cached_tokens"] > 0  # same prompt again: prefix cache hit


def test_generate_stream_and_stop(default_server: ServerHandle) -> None:
    params = {"max_new_tokens": 6, "temperature": 0}
    _, full = default_server.post("/generate", {"text": PROMPT, "sampling_params": params})
    status, text = http(
        "POST", default_server.url("/generate"),
        {"text": PROMPT, "sampling_params": params, "stream": True},
    )  # fmt: skip
    assert status == 200
    events = sse_events(text)
    # Like SGLang, each event carries the text so far.
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert texts[-1] == full["text"]
    finishes = [e["meta_info"]["finish_reason"] for e in events]
    assert all(f is None for f in finishes[:-1]) and finishes[-1] is not None
    # A stop token id ends the output with finish_reason stop / matched = the id.
    stop_id = full["output_ids"][2]
    _, stopped = default_server.post(
        "/generate",
        {"text": PROMPT, "sampling_params": {**params, "stop_token_ids": [stop_id]}},
    )
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert stopped["output_ids"] == full["output_ids"][:3]


def test_generate_eos_stop_names_the_token(default_server: ServerHandle, tokenizer: Any) -> None:
    """A natural end of turn: SmolLM2-Instruct answers the chat prompt (greedy) and ends with
    its EOS, <|im_end|>. Like SGLang, finish_reason is {"type": "stop", "matched": <EOS id>}
    (the EOS id is the last output id; its text is not in the text), whole and streamed; the
    OpenAI route reports the same id as matched_stop."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 32, "temperature": 0}}
    status, out = default_server.post("/generate", body)
    assert status == 200, out
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": eos}, out
    assert out["output_ids"][-1] == eos and meta["completion_tokens"] < 32
    assert "Paris" in out["text"] and "<|im_end|>" not in out["text"]
    status, text = http("POST", default_server.url("/generate"), {**body, "stream": True})
    assert status == 200
    last = sse_events(text)[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert last["text"] == out["text"]
    status, chat = default_server.post("/v1/chat/completions", {**GOOD_CHAT, "max_tokens": 32})
    assert status == 200, chat
    assert chat["choices"][0]["finish_reason"] == "stop"
    assert chat["choices"][0]["matched_stop"] == eos


def test_raw_openai_sse_framing(default_server: ServerHandle) -> None:
    """Byte-level SSE: ``data: {json}\n\n`` per event and one final ``data: [DONE]\n\n``."""
    body = {**GOOD_CHAT, "stream": True, "stream_options": {"include_usage": True}}
    status, text = http("POST", default_server.url("/v1/chat/completions"), body)
    assert status == 200
    events = sse_events(text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 2
    status, text = http(
        "POST",
        default_server.url("/v1/completions"),
        {"prompt": PROMPT, "max_tokens": 2, "stream": True},
    )
    assert status == 200
    assert all(e["object"] == "text_completion" for e in sse_events(text))


def test_info_routes(default_server: ServerHandle) -> None:
    assert default_server.get("/health") == (200, {"status": "ok"})
    status, info = default_server.get("/get_model_info")
    assert status == 200 and info["served_model_name"] == "smollm2"
    assert info["context_length"] == 8192
    # SGLang's router registers a worker from these (the names sglang-router 0.3.2 reads).
    for path in ("/model_info", "/server_info", "/get_server_info"):
        status, same = default_server.get(path)
        assert status == 200 and same["served_model_name"] == "smollm2", (path, same)
        assert same["model_path"] == info["model_path"]
        assert Path(same["tokenizer_path"], "tokenizer_config.json").is_file()
    _, model = default_server.get("/model_info")
    assert model["model_type"] == "llama" and model["architectures"] == ["LlamaForCausalLM"]
    _, server = default_server.get("/server_info")
    assert server["dp_size"] == 1 and server["tp_size"] == 1 and server["version"]
    assert server["max_total_tokens"] == info["num_pages"] * info["page_size"]
    assert server["max_running_requests"] > 0 and server["max_prefill_tokens"] > 0
    status, flushed = default_server.post("/flush_cache")
    assert status == 200 and flushed["success"] is True


LONG_TEXT = "hello " * 9000  # well over the 8192-token context

BAD_REQUESTS: list[tuple[str, str, Any]] = [
    ("malformed json", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}'),
    ("max_tokens -1", "/v1/chat/completions", {**GOOD_CHAT, "max_tokens": -1}),
    ("temperature -1", "/v1/chat/completions", {**GOOD_CHAT, "temperature": -1}),
    ("top_p 2", "/v1/chat/completions", {**GOOD_CHAT, "top_p": 2}),
    ("n 0", "/v1/chat/completions", {**GOOD_CHAT, "n": 0}),
    ("messages not a list", "/v1/chat/completions", {**GOOD_CHAT, "messages": "hello"}),
    ("message without role", "/v1/chat/completions", {**GOOD_CHAT, "messages": [{"content": "x"}]}),
    ("unknown role", "/v1/chat/completions", {**GOOD_CHAT, "messages": [{"role": "x", "content": "y"}]}),
    ("no messages", "/v1/chat/completions", {**GOOD_CHAT, "messages": []}),
    ("top_logprobs without logprobs", "/v1/chat/completions", {**GOOD_CHAT, "top_logprobs": 2}),
    ("overlong chat", "/v1/chat/completions", {**GOOD_CHAT, "messages": [{"role": "user", "content": LONG_TEXT}]}),
    ("overlong stream", "/v1/completions", {"prompt": LONG_TEXT, "max_tokens": 2, "stream": True}),
    ("prompt + max_tokens > context", "/v1/completions", {"prompt": "Hi", "max_tokens": 9000}),
    ("empty prompt", "/v1/completions", {"prompt": "", "max_tokens": 2}),
    ("token id out of range", "/v1/completions", {"prompt": [10**9], "max_tokens": 2}),
    ("mixed prompt list", "/v1/completions", {"prompt": ["a", [1, 2]], "max_tokens": 2}),
    ("generate without prompt", "/generate", {"sampling_params": {"max_new_tokens": 2}}),
    ("generate with no texts", "/generate", {"text": []}),  # hung: a group of no requests
    ("generate with an empty id batch", "/generate", {"input_ids": [[]]}),
    ("generate unknown param", "/generate", {"text": "hi", "sampling_params": {"max_tokens": 2}}),
    ("seed too large", "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "seed": 2**70}),
    ("logit_bias", "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "logit_bias": {"5": 1.0}}),
    ("unknown output format", "/v1/chat/completions", {**GOOD_CHAT, "response_format": {"type": "xml"}}),
    ("json_schema not JSON", "/v1/chat/completions", {**GOOD_CHAT, "json_schema": "{oops"}),
    ("regex that does not compile", "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "regex": "(["}),
    ("tool without a name", "/v1/chat/completions", {**GOOD_CHAT, "tools": [{"type": "function", "function": {}}]}),
    ("tool_choice naming no tool", "/v1/chat/completions", {**GOOD_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body"), [(p, b) for _, p, b in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS]
)
def test_bad_request_is_400_and_server_survives(
    default_server: ServerHandle, path: str, body: Any
) -> None:
    if isinstance(body, bytes):
        status, out = default_server.post(path, raw=body)
    else:
        status, out = default_server.post(path, body)
    assert status == 400, out
    err = out["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400 and "param" in err


def test_good_request_after_bad_ones(default_server: ServerHandle) -> None:
    status, out = default_server.post("/v1/chat/completions", GOOD_CHAT)
    assert status == 200 and out["choices"][0]["message"]["content"]


def test_error_messages_name_the_problem(default_server: ServerHandle) -> None:
    _, out = default_server.post("/v1/chat/completions", {**GOOD_CHAT, "temperature": -1})
    assert out["error"]["param"] == "temperature" and "temperature" in out["error"]["message"]
    _, out = default_server.post("/v1/completions", {"prompt": LONG_TEXT, "max_tokens": 2})
    assert "context length" in out["error"]["message"]
    status, out = default_server.get("/no/such/route")
    assert status == 404 and out["error"]["code"] == 404


def test_zz_nothing_leaked(default_server: ServerHandle) -> None:
    wait_idle_and_check(default_server)
