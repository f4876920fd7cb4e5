"""OpenAI's Responses API, POST /v1/responses: text in, one assistant message out.

The request becomes a chat conversation (``instructions`` as the system message, then the
``input`` messages) and runs like a chat completion: same sampling checks and structured
output (``text.format``). What it does not implement is refused with a 400 naming the
field: tools, ``previous_response_id`` (nothing is stored), non-text input parts.
Streaming sends the API's typed events, from ``response.created`` to ``response.completed``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from minisgl.ipc.messages import TextOutput
from minisgl.server.errors import bad_request
from minisgl.server.frontend import RequestGroup, SequenceResult, make_items
from minisgl.server.protocol import ChatCompletionRequest
from minisgl.server.state import server_state
from minisgl.server.streaming import respond, sse_event, sse_stream

router = APIRouter()


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | ...}}
    tools: list[Any] | None = None
    tool_choice: Any = None
    previous_response_id: str | None = None
    store: bool | None = None  # accepted; nothing is stored
    metadata: dict[str, str] | None = None
    user: str | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The equivalent chat completion (ValueError naming the field if there is none)."""
        if self.tools:
            raise ValueError("tools must be empty: this server's Responses API has no tools")
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id must be unset: responses are not stored")
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            messages += [_message(item) for item in self.input]
        fmt = (self.text or {}).get("format") or {"type": "text"}
        if not isinstance(fmt, dict):
            raise ValueError("text must be {'format': {'type': ...}}")
        if fmt.get("type") == "json_schema":  # the schema sits in the format itself here
            fmt = {"type": "json_schema", "json_schema": fmt}
        return ChatCompletionRequest(
            messages=messages,  # type: ignore[arg-type]
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stream=self.stream,
            response_format=fmt,
        )


def _message(item: dict[str, Any]) -> dict[str, Any]:
    if item.get("type", "message") != "message" or item.get("role") not in (
        "user", "system", "developer", "assistant",
    ):  # fmt: skip
        raise ValueError("input must be a string or a list of messages with a role and content")
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
                raise ValueError("input must carry text parts only (input_text / output_text)")
            texts.append(str(part.get("text", "")))
        content = "".join(texts)
    if not isinstance(content, str):
        raise ValueError("input messages must have text content")
    return {"role": item["role"], "content": content}


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request) -> Response:
    state = server_state(request)
    try:
        chat = body.chat_request()
        fields = chat.sampling_fields()
    except ValueError as exc:
        raise bad_request(exc) from None
    items = make_items([chat.message_dicts()], [fields], **chat.template_fields())
    group = state.submit(items)
    rid, msg_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
    state.frontend.name(group, rid)  # for /abort_request
    created = time.time()

    def response(status: str, result: SequenceResult | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": rid, "object": "response", "created_at": created, "model": state.served_model_name,
            "status": status, "output": [], "parallel_tool_calls": False, "tool_choice": "none",
            "tools": [], "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "metadata": body.metadata or {},
            "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
            "incomplete_details": None, "error": None, "usage": None,
        }  # fmt: skip
        if result is None:
            return out
        out["output"] = [_item(msg_id, "completed", result.text)]
        if result.finish_reason == "length":
            out["status"] = "incomplete"
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        out["usage"] = {
            "input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": result.cached_tokens},
            "output_tokens": result.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + result.completion_tokens,
        }
        return out

    def full(results: list[SequenceResult]) -> dict[str, Any]:
        return response("completed", results[0])

    async def stream(group: RequestGroup, first: TextOutput) -> AsyncIterator[str]:
        seq = iter(range(1 << 62))

        def event(kind: str, **data: Any) -> str:
            return sse_event(kind, {"sequence_number": next(seq), **data})

        where = {"item_id": msg_id, "output_index": 0, "content_index": 0}
        yield (
            event("response.created", response=response("in_progress", None))
            + event("response.in_progress", response=response("in_progress", None))
            + event("response.output_item.added", output_index=0,
                    item={**_item(msg_id, "in_progress", ""), "content": []})
            + event("response.content_part.added", **where, part=_part(""))
        )  # fmt: skip
        results = [SequenceResult()]

        def render(_: int, out: TextOutput) -> str | None:
            chunk = event("response.output_text.delta", **where, delta=out.text, logprobs=[])
            chunk = chunk if out.text else ""
            if out.finished:
                r = results[0]
                done = response("completed", r)
                chunk += (
                    event("response.output_text.done", **where, text=r.text, logprobs=[])
                    + event("response.content_part.done", **where, part=_part(r.text))
                    + event("response.output_item.done", output_index=0, item=done["output"][0])
                    + event(f"response.{'incomplete' if done['status'] == 'incomplete' else 'completed'}",
                            response=done)
                )  # fmt: skip
            return chunk or None

        def failed(_: int, error: str) -> str:
            return event("response.failed", response={**response("failed", None),
                         "error": {"code": "server_error", "message": error}})  # fmt: skip

        async for data in sse_stream(group, first, results, render, failed):
            yield data

    return await respond(request, group, body.stream, stream, full)


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _item(msg_id: str, status: str, text: str) -> dict[str, Any]:
    return {"id": msg_id, "type": "message", "status": status, "role": "assistant",
            "content": [_part(text)]}  # fmt: skip
