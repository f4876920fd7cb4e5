"""OpenAI-compatible routes: POST /v1/chat/completions and POST /v1/completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from minisgl.ipc.messages import TextOutput, TokenLogprob
from minisgl.server.chat_reply import ChatReplyParser
from minisgl.server.errors import bad_request
from minisgl.server.frontend import RequestGroup, SequenceResult, make_items
from minisgl.server.protocol import ChatCompletionRequest, CompletionRequest, choice_params
from minisgl.server.state import server_state
from minisgl.server.streaming import respond, sse, sse_stream, usage

router = APIRouter()


@dataclass(frozen=True)
class _Envelope:
    """The fields every response and chunk of one request repeats."""

    id: str
    object: str
    created: int
    model: str

    def wrap(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id, "object": self.object, "created": self.created, "model": self.model,
            "choices": choices, **extra,
        }  # fmt: skip


def _token_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
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
) -> dict[str, Any]:
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
    body: ChatCompletionRequest | CompletionRequest,
    results: list[SequenceResult],
    n: int,
    speculative: bool,
) -> Callable[[], dict[str, Any]]:
    """The usage field of a streamed chunk: the running usage with continuous_usage_stats,
    null when only the final usage chunk carries it, absent otherwise."""
    if body.continuous_usage:
        return lambda: {"usage": usage(results, n, speculative)}
    fields: dict[str, Any] = {"usage": None} if body.include_usage else {}
    return lambda: fields


# ---------------------------------------------------------------- chat
@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = server_state(request)
    try:
        fields = body.sampling_fields(state.reasoning_parser)
        messages = body.message_dicts()
    except ValueError as exc:
        raise bad_request(exc) from None
    n = fields["n"]
    items = make_items(
        [messages],
        [choice_params(fields, i) for i in range(n)],
        priority=body.priority or 0,
        **body.template_fields(),
    )
    group = state.submit(items)
    env = _Envelope(
        f"chatcmpl-{uuid.uuid4().hex}", "chat.completion", int(time.time()), state.served_model_name
    )
    state.frontend.name(group, env.id)  # for /abort_request
    reasoning = state.reasoning_parser if body.separate_reasoning else None

    def parser() -> ChatReplyParser | None:
        if reasoning is None and not body.uses_tools:
            return None
        return ChatReplyParser(reasoning, body.uses_tools, body.parallel_tool_calls is not False)

    def full(results: list[SequenceResult]) -> dict[str, Any]:
        choices = []
        for i, r in enumerate(results):
            message: dict[str, Any] = {"role": "assistant", "content": r.text}
            finish = r.finish_reason
            reply = parser()
            if reply is not None:
                fields, calls = reply.whole(r.text)
                message.update(fields)
                finish = "tool_calls" if calls and finish == "stop" else finish
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": chat_logprobs(r.logprobs) if body.logprobs else None,
                    "finish_reason": finish,
                    "matched_stop": r.matched_stop,
                }
            )
        return env.wrap(choices, usage=usage(results, n, state.speculative))

    async def stream(group: RequestGroup, first: TextOutput) -> AsyncIterator[str]:
        chunk_env = _Envelope(env.id, "chat.completion.chunk", env.created, env.model)
        results = [SequenceResult(prompt_tokens=first.prompt_tokens) for _ in group.rids]
        extra = stream_usage(body, results, n, state.speculative)

        def chunk(
            i: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None
        ) -> str:
            choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return sse(chunk_env.wrap([choice], **extra()))

        yield "".join(chunk(i, {"role": "assistant", "content": ""}) for i in range(n))
        parsers = [parser() for _ in range(n)]

        def render(i: int, out: TextOutput) -> str | None:
            finish, reply = out.finish_reason, parsers[i]
            calls: list[dict[str, Any]] = []
            delta: dict[str, Any] = {"content": out.text} if out.text else {}
            if reply is not None:
                delta = dict(reply.feed(out.text))
                if out.finished:
                    last, calls = reply.finish()
                    for key, value in last.items():
                        delta[key] = delta.get(key, "") + value
                    finish = "tool_calls" if calls and finish == "stop" else finish
            logprobs = chat_logprobs(out.logprobs) if body.logprobs and out.logprobs else None
            if out.finished:
                if calls:  # each call whole, in one delta (OpenAI allows arguments in pieces)
                    delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
                return chunk(i, delta, logprobs, finish)
            return chunk(i, delta, logprobs) if delta or logprobs else None

        def tail() -> str | None:
            if not body.include_usage:
                return None
            return sse(chunk_env.wrap([], usage=usage(results, n, state.speculative)))

        async for data in sse_stream(
            group, first, results, render, lambda j, _: chunk(j, {}, None, "abort"), tail
        ):
            yield data

    return await respond(request, group, body.stream, stream, full)


# ---------------------------------------------------------------- completions
@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = server_state(request)
    try:
        fields = body.sampling_fields()
        prompts = body.prompts()
    except ValueError as exc:
        raise bad_request(exc) from None
    n = fields["n"]
    want_logprobs = body.logprobs is not None
    if body.echo and want_logprobs:
        # Score the prompt too (what evaluation harnesses use for log-likelihoods).
        fields["prompt_logprobs"] = int(body.logprobs or 0)
    items = make_items(
        prompts, [choice_params(fields, i) for i in range(n)],
        return_prompt_text=body.echo, return_prompt_tokens=body.echo and want_logprobs,
        priority=body.priority or 0,
    )  # fmt: skip
    group = state.submit(items)
    env = _Envelope(
        f"cmpl-{uuid.uuid4().hex}", "text_completion", int(time.time()), state.served_model_name
    )
    state.frontend.name(group, env.id)  # for /abort_request

    def full(results: list[SequenceResult]) -> dict[str, Any]:
        choices = []
        for i, r in enumerate(results):
            prefix = (r.prompt_text or "") if body.echo else ""
            logprobs = None
            if want_logprobs:
                logprobs = completion_logprobs(
                    r.logprobs,
                    0,
                    r.prompt_token_strs if body.echo else None,
                    r.prompt_logprobs if body.echo else None,
                )
            choices.append(
                {"index": i, "text": prefix + r.text, "logprobs": logprobs,
                 "finish_reason": r.finish_reason, "matched_stop": r.matched_stop}
            )  # fmt: skip
        return env.wrap(choices, usage=usage(results, n, state.speculative))

    async def stream(group: RequestGroup, first: TextOutput) -> AsyncIterator[str]:
        results = [SequenceResult() for _ in group.rids]
        extra = stream_usage(body, results, n, state.speculative)
        # Per choice: the text_offset of its next token. It advances by the tokens' own text,
        # not by the text sent so far (held back while it may begin a stop string, or an
        # unfinished character), so the offsets are those of the non-streamed response.
        offsets = [0] * len(group.rids)

        def choice_chunk(i: int, text: str, logprobs: Any, finish: str | None) -> str:
            choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}
            return sse(env.wrap([choice], **extra()))

        def render(i: int, out: TextOutput) -> str | None:
            text = out.text
            if body.echo and out.prompt_text is not None:
                text = out.prompt_text + text
            logprobs = None
            if want_logprobs and (out.logprobs or out.prompt_token_strs):
                logprobs = completion_logprobs(
                    out.logprobs or [], offsets[i], out.prompt_token_strs, out.prompt_logprobs
                )
                offsets[i] += sum(map(len, logprobs["tokens"]))
            if out.finished or text or logprobs:
                return choice_chunk(i, text, logprobs, out.finish_reason)
            return None

        def tail() -> str | None:
            if not body.include_usage:
                return None
            return sse(env.wrap([], usage=usage(results, n, state.speculative)))

        async for data in sse_stream(
            group, first, results, render, lambda j, _: choice_chunk(j, "", None, "abort"), tail
        ):
            yield data

    return await respond(request, group, body.stream, stream, full)
