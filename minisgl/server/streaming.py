"""The request/response flow shared by every generation route.

1. Wait for the first output (or the client leaving). An error there (bad prompt, too long)
   becomes a proper HTTP error, even for stream=true: nothing was queued yet.
2. Streaming: SSE lines ``data: {json}\\n\\n`` ending with ``data: [DONE]\\n\\n``. Whatever
   ends the response (done, client gone, server stopping), the group is closed, which aborts
   unfinished sequences in the scheduler and frees their KV.
3. Non-streaming: collect all outputs, racing the client's disconnect.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from minisgl.ipc.messages import JSONDict, TextOutput
from minisgl.server.errors import ClientGone, engine_error, sse_error
from minisgl.server.reports import usage_reports
from minisgl.server.request_group import RequestGroup, SequenceResult

DONE = "data: [DONE]\n\n"
CLIENT_CLOSED_REQUEST = 499  # nginx's convention; the client never sees it


# json.dumps(payload, ensure_ascii=False) builds a new encoder per call; one chunk per token
# per stream makes that cost count. The output is the same.
_encode_json = json.JSONEncoder(ensure_ascii=False).encode


def sse(payload: JSONDict) -> str:
    return f"data: {_encode_json(payload)}\n\n"


def sse_event(kind: str, payload: JSONDict) -> str:
    """A named SSE event (the Responses API's: its name also in the payload's ``type``)."""
    return f"event: {kind}\ndata: {_encode_json({'type': kind, **payload})}\n\n"


class SSEResponse(StreamingResponse):
    """A streaming response written by the request's own task, that always runs
    ``on_close`` when it ends, however it ends.

    Starlette's StreamingResponse (ASGI spec < 2.4, as uvicorn declares) starts a task for
    the body and another for the disconnect: the first chunk then waits for that task's
    first turn, behind every handler of a burst of arriving requests. Here the first chunk
    goes out in the same turn that the first output woke the request; the group's
    disconnect watcher (see respond) ends the body instead."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.stream_response(send)
        except OSError:
            pass  # ASGI 2.4 servers report a gone client this way; nothing left to send to
        finally:
            self.on_close()


async def _watch_disconnect(request: Request, group: RequestGroup) -> None:
    # The body was already read, so the next ASGI message is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            group.client_gone()
            return


async def collect(group: RequestGroup, first: TextOutput) -> list[SequenceResult]:
    results = [SequenceResult() for _ in group.rids]
    async for out in group.outputs(first):
        results[group.index[out.rid]].add(out)
    return results


StreamFn = Callable[[RequestGroup, TextOutput], AsyncIterator[str]]
FullFn = Callable[[list[SequenceResult]], object]  # the JSON body


async def respond(
    request: Request, group: RequestGroup, stream: bool, make_stream: StreamFn, make_full: FullFn
) -> Response:
    # One watcher for the whole response: a disconnect wakes whatever waits on the group.
    watcher = asyncio.ensure_future(_watch_disconnect(request, group))

    def finish() -> None:
        watcher.cancel()
        group.close()

    handed_over = False
    try:
        first = await group.first()
        if first.error is not None:
            raise engine_error(first.error_status, first.error)
        if stream:
            handed_over = True  # from here on the response closes the group
            return SSEResponse(make_stream(group, first), on_close=finish)
        results = await collect(group, first)
        if group.gone:
            raise ClientGone()
        failed = next((r for r in results if r.error is not None), None)
        if failed is not None:
            raise engine_error(failed.error_status, failed.error or "request failed")
        return JSONResponse(make_full(results))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        if not handed_over:
            finish()


def open_choices(results: list[SequenceResult]) -> list[int]:
    """Indices of the choices that have not finished yet."""
    return [i for i, r in enumerate(results) if r.finish_reason is None]


async def sse_stream(
    group: RequestGroup,
    first: TextOutput,
    results: list[SequenceResult],
    render: Callable[[int, TextOutput], str | None],
    render_abort: Callable[[int, str], str],
    tail: Callable[[], str | None] | None = None,
) -> AsyncIterator[str]:
    """A route's SSE body: one write per batch of outputs (RequestGroup.batches), not one per
    chunk. Each output is added to its choice's result, then ``render(choice, output)`` gives
    its chunk (None: nothing to send). An error ends the stream: every choice still open gets
    ``render_abort(choice, error)``, then the error event says why (timeout, shutdown, engine
    failure). Otherwise ``tail()`` (e.g. a usage chunk) comes last; [DONE] always closes."""
    async for batch in group.batches(first):
        chunks: list[str] = []
        for out in batch:
            if out.error is not None:
                chunks += [render_abort(j, out.error) for j in open_choices(results)]
                chunks.append(sse_error(out.error_status or 500, out.error))
                yield "".join(chunks)
                yield DONE
                return
            i = group.index[out.rid]
            results[i].add(out)
            chunk = render(i, out)
            if chunk is not None:
                chunks.append(chunk)
        if chunks:
            yield "".join(chunks)
    last = tail() if tail is not None else None
    if last is not None:
        yield last
    yield DONE


def usage(results: list[SequenceResult], n: int) -> JSONDict:
    """OpenAI usage: each prompt counted once (not once per choice), completions summed; then
    what extensions report from the choices' counters (e.g. speculation's figures)."""
    prompt = cached = 0
    for start in range(0, len(results), n):
        choices = results[start : start + n]
        prompt += max(r.prompt_tokens for r in choices)
        cached += max(r.cached_tokens for r in choices)
    completion = sum(r.completion_tokens for r in results)
    out: JSONDict = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    for report in usage_reports([r.counters for r in results]):
        out.update(report.usage)
    return out
