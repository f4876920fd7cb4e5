"""OpenAI-compatible routes: POST /v1/chat/completions and POST /v1/completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import Response

from minisgl.ipc.messages import JSONDict, SubmitItem, TextOutput
from minisgl.server.chat_hooks import ChatHook, ReplyParser
from minisgl.server.errors import bad_request
from minisgl.server.openai_format import (
    Envelope,
    chat_logprobs,
    completion_logprobs,
    stream_usage,
    usage_chunk,
)
from minisgl.server.protocol import ChatCompletionRequest, CompletionRequest
from minisgl.server.request_group import RequestGroup, SequenceResult
from minisgl.server.state import server_state
from minisgl.server.streaming import respond, sse, sse_stream, usage

router = APIRouter()


def _envelope(prefix: str, kind: str, model: str) -> Envelope:
    return Envelope(f"{prefix}-{uuid.uuid4().hex}", kind, int(time.time()), model)


# ---------------------------------------------------------------- chat
@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = server_state(request)
    try:
        params = body.to_sampling_params(state.chat)
        messages = body.message_dicts()
    except ValueError as exc:
        raise bad_request(exc) from None
    env = _envelope("chatcmpl", "chat.completion", state.served_model_name)
    group = state.submit([messages], params, body.submit_base(), env.id)
    reply = ChatReply(body, env, params.n, state.chat)
    return await respond(request, group, body.stream, reply.stream, reply.full)


class ChatReply:
    """One chat completion's response body, whole or streamed. A reply parser per choice
    (the chat hook's: reasoning, tool calls) shapes its message."""

    def __init__(self, body: ChatCompletionRequest, env: Envelope, n: int, hook: ChatHook):
        self.body, self.env, self.n = body, env, n
        self.hook, self.tools = hook, body.chat_tools()

    def parser(self) -> ReplyParser | None:
        return self.hook.reply_parser(self.tools)

    def full(self, results: list[SequenceResult]) -> JSONDict:
        choices = [self._choice(i, r) for i, r in enumerate(results)]
        return self.env.wrap(choices, {"usage": usage(results, self.n)})

    def _choice(self, index: int, r: SequenceResult) -> JSONDict:
        message: JSONDict = {"role": "assistant", "content": r.text}
        finish = r.finish_reason
        reply = self.parser()
        if reply is not None:
            fields, calls = reply.whole(r.text)
            message.update(fields)
            finish = "tool_calls" if calls and finish == "stop" else finish
        return {
            "index": index,
            "message": message,
            "logprobs": chat_logprobs(r.logprobs) if self.body.logprobs else None,
            "finish_reason": finish,
            "matched_stop": r.matched_stop,
        }

    async def stream(self, group: RequestGroup, first: TextOutput) -> AsyncIterator[str]:
        results = [SequenceResult(prompt_tokens=first.prompt_tokens) for _ in group.rids]
        parsers = [self.parser() for _ in range(self.n)]
        chunks = _ChatChunks(self, parsers, stream_usage(self.body, results, self.n))
        yield "".join(chunks.chunk(i, {"role": "assistant", "content": ""}) for i in range(self.n))
        tail = partial(usage_chunk, self.body, chunks.env, results, self.n)
        async for data in sse_stream(group, first, results, chunks.render, chunks.abort, tail):
            yield data


class _ChatChunks:
    """The chunks of one streamed chat completion."""

    def __init__(
        self, reply: ChatReply, parsers: list[ReplyParser | None], extra: Callable[[], JSONDict]
    ) -> None:
        self.env = reply.env.chunks("chat.completion.chunk")
        self.logprobs = reply.body.logprobs
        self.parsers = parsers
        self.extra = extra  # the usage field of each chunk (openai_format.stream_usage)

    def chunk(
        self, i: int, delta: JSONDict, logprobs: JSONDict | None = None, finish: str | None = None
    ) -> str:
        choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse(self.env.wrap([choice], self.extra()))

    def abort(self, i: int, error: str) -> str:
        return self.chunk(i, {}, None, "abort")

    def render(self, i: int, out: TextOutput) -> str | None:
        finish, reply = out.finish_reason, self.parsers[i]
        calls: list[JSONDict] = []
        delta: JSONDict = {"content": out.text} if out.text else {}
        if reply is not None:
            delta = dict(reply.feed(out.text))
            if out.finished:
                last, calls = reply.finish()
                for key, value in last.items():
                    delta[key] = str(delta.get(key, "")) + value
                finish = "tool_calls" if calls and finish == "stop" else finish
        logprobs = chat_logprobs(out.logprobs) if self.logprobs and out.logprobs else None
        if out.finished:
            if calls:  # each call whole, in one delta (OpenAI allows arguments in pieces)
                delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
            return self.chunk(i, delta, logprobs, finish)
        return self.chunk(i, delta, logprobs) if delta or logprobs else None


# ---------------------------------------------------------------- completions
@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = server_state(request)
    try:
        params = body.to_sampling_params()
        prompts = body.prompts()
    except ValueError as exc:
        raise bad_request(exc) from None
    base = SubmitItem(
        0,
        return_prompt_text=body.echo,
        return_prompt_tokens=body.echo and body.logprobs is not None,
        priority=body.priority or 0,
    )
    env = _envelope("cmpl", "text_completion", state.served_model_name)
    group = state.submit(prompts, params, base, env.id)
    reply = CompletionReply(body, env, params.n)
    return await respond(request, group, body.stream, reply.stream, reply.full)


class CompletionReply:
    """One text completion's response body, whole or streamed."""

    def __init__(self, body: CompletionRequest, env: Envelope, n: int) -> None:
        self.body, self.env, self.n = body, env, n
        self.echo, self.want_logprobs = body.echo, body.logprobs is not None

    def full(self, results: list[SequenceResult]) -> JSONDict:
        choices = [self._choice(i, r) for i, r in enumerate(results)]
        return self.env.wrap(choices, {"usage": usage(results, self.n)})

    def _choice(self, index: int, r: SequenceResult) -> JSONDict:
        prefix = (r.prompt_text or "") if self.echo else ""
        logprobs = None
        if self.want_logprobs:
            logprobs = completion_logprobs(
                r.logprobs,
                0,
                r.prompt_token_strs if self.echo else None,
                r.prompt_logprobs if self.echo else None,
            )
        return {
            "index": index,
            "text": prefix + r.text,
            "logprobs": logprobs,
            "finish_reason": r.finish_reason,
            "matched_stop": r.matched_stop,
        }

    async def stream(self, group: RequestGroup, first: TextOutput) -> AsyncIterator[str]:
        results = [SequenceResult() for _ in group.rids]
        extra = stream_usage(self.body, results, self.n)
        # Per choice: the text_offset of its next token. It advances by the tokens' own text,
        # not by the text sent so far (held back while it may begin a stop string, or an
        # unfinished character), so the offsets are those of the non-streamed response.
        offsets = [0] * len(group.rids)

        def chunk(i: int, text: str, logprobs: JSONDict | None, finish: str | None) -> str:
            choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}
            return sse(self.env.wrap([choice], extra()))

        def render(i: int, out: TextOutput) -> str | None:
            text = out.text
            if self.echo and out.prompt_text is not None:
                text = out.prompt_text + text
            logprobs = None
            if self.want_logprobs and (out.logprobs or out.prompt_token_strs):
                logprobs = completion_logprobs(
                    out.logprobs or [], offsets[i], out.prompt_token_strs, out.prompt_logprobs
                )
                # The tokens' own text: the prompt's (first output, with echo), then the new.
                offsets[i] += sum(map(len, out.prompt_token_strs or []))
                offsets[i] += sum(len(e.token) for e in out.logprobs or [])
            if out.finished or text or logprobs:
                return chunk(i, text, logprobs, out.finish_reason)
            return None

        tail = partial(usage_chunk, self.body, self.env, results, self.n)
        async for data in sse_stream(
            group, first, results, render, lambda j, _: chunk(j, "", None, "abort"), tail
        ):
            yield data
