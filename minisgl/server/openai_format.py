"""Pieces of OpenAI response bodies that the chat and text completion routes share: the
envelope every response and chunk repeats, logprobs in both APIs' shapes, streamed usage."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from minisgl.ipc.messages import JSONDict, TokenLogprob
from minisgl.server.protocol import ChatCompletionRequest, CompletionRequest
from minisgl.server.request_group import SequenceResult
from minisgl.server.streaming import sse, usage


@dataclass(frozen=True)
class Envelope:
    """The fields every response and chunk of one request repeats."""

    id: str
    object: str
    created: int
    model: str

    def wrap(self, choices: list[JSONDict], extra: JSONDict | None = None) -> JSONDict:
        body: JSONDict = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if extra:
            body.update(extra)
        return body

    def chunks(self, kind: str) -> Envelope:
        """The envelope of this response's streamed chunks (``kind``: their object)."""
        return Envelope(self.id, kind, self.created, self.model)


def _token_entry(token: str, logprob: float) -> JSONDict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(entries: list[TokenLogprob]) -> JSONDict:
    content = []
    for e in entries:
        item = _token_entry(e.token, e.logprob)
        item["top_logprobs"] = [_token_entry(t.token, t.logprob) for t in e.top]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(
    entries: list[TokenLogprob],
    offset: int,
    prompt_tokens: list[str] | None = None,
    prompt_entries: list[TokenLogprob] | None = None,
) -> JSONDict:
    """Legacy completions logprobs. text_offset (as vLLM's) is where each token starts in the
    choice's ``text`` (with echo, the prompt's text first): ``offset`` plus the length of the
    tokens before it. OpenAI's legacy API counted from the start of the prompt even without
    echo; counting from the returned text is what vLLM does and what indexes ``text``."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    # echo: the first prompt token has no logprob (nothing precedes it); token i >= 1 has
    # the engine's log P(token i | tokens < i) and its top alternatives.
    scored = prompt_entries or []
    rows: list[tuple[str, float | None, dict[str, float] | None]] = [
        (tok, None, None)
        if i == 0 or i > len(scored)
        else (tok, scored[i - 1].logprob, {t.token: t.logprob for t in scored[i - 1].top} or None)
        for i, tok in enumerate(prompt_tokens or [])
    ]
    rows += [(e.token, e.logprob, {t.token: t.logprob for t in e.top}) for e in entries]
    for token, logprob, alternatives in rows:
        tokens.append(token)
        token_logprobs.append(logprob)
        top.append(alternatives)
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def stream_usage(
    body: ChatCompletionRequest | CompletionRequest, results: list[SequenceResult], n: int
) -> Callable[[], JSONDict]:
    """The usage field of a streamed chunk: the running usage with continuous_usage_stats,
    null when only the final usage chunk carries it, absent otherwise."""
    if body.continuous_usage:
        return lambda: {"usage": usage(results, n)}
    fields: JSONDict = {"usage": None} if body.include_usage else {}
    return lambda: fields


def usage_chunk(
    body: ChatCompletionRequest | CompletionRequest,
    env: Envelope,
    results: list[SequenceResult],
    n: int,
) -> str | None:
    """The final chunk (SSE) with the whole usage, when the client asked for it."""
    return sse(env.wrap([], {"usage": usage(results, n)})) if body.include_usage else None
