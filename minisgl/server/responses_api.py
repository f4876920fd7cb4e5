"""OpenAI's Responses API, POST /v1/responses: text in; an assistant message and function
calls out.

The request becomes a chat conversation (``instructions`` as the system message, then the
``input`` items: messages, earlier ``function_call`` items as the assistant's tool calls,
``function_call_output`` items as tool messages) and runs like a chat completion: the same
sampling checks, structured output (``text.format``) and tool calling (function tools,
``tool_choice``; server/tool_calls.py). What it does not implement is refused with a 400
naming the field: other tool types, ``previous_response_id`` (nothing is stored), non-text
input parts. Streaming sends the API's typed events, from ``response.created`` to
``response.completed``; function calls come whole after the message.
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
from minisgl.server.chat_reply import ChatReplyParser
from minisgl.server.errors import bad_request
from minisgl.server.frontend import RequestGroup, SequenceResult, make_items
from minisgl.server.protocol import ChatCompletionRequest, Priority
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
    parallel_tool_calls: bool | None = None  # false: only the reply's first call is kept
    previous_response_id: str | None = None
    store: bool | None = None  # accepted; nothing is stored
    metadata: dict[str, str] | None = None
    user: str | None = None
    priority: Priority = None  # vLLM's extra field

    def chat_request(self) -> ChatCompletionRequest:
        """The equivalent chat completion (ValueError naming the field if there is none)."""
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id must be unset: responses are not stored")
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            for item in self.input:
                _add_item(messages, item)
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
            tools=[_chat_tool(t) for t in self.tools] if self.tools else None,
            tool_choice=_chat_tool_choice(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls,
            priority=self.priority,
        )


def _chat_tool(tool: Any) -> dict[str, Any]:
    """A Responses function tool ({"type": "function", "name", "parameters"}) as a chat one."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ValueError("tools must be function tools: {'type': 'function', 'name': ...}")
    fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _add_item(messages: list[dict[str, Any]], item: Any) -> None:
    """One input item onto the conversation: a message, an earlier function call (merged into
    the assistant message before it), or a call's output (a tool message)."""
    kind = item.get("type", "message") if isinstance(item, dict) else None
    if kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}  # fmt: skip
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            raise ValueError("input function_call_output items must carry their output as text")
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
    else:
        messages.append(_message(item))


def _message(item: Any) -> dict[str, Any]:
    if not isinstance(item, dict) or item.get("type", "message") != "message" or item.get("role") not in (
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
        messages = chat.message_dicts()  # earlier calls' arguments must be JSON: a 400 if not
    except ValueError as exc:
        raise bad_request(exc) from None
    items = make_items([messages], [fields], priority=chat.priority or 0, **chat.template_fields())
    group = state.submit(items)
    rid, msg_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
    state.frontend.name(group, rid)  # for /abort_request
    created = time.time()

    tools = chat.uses_tools
    parallel = body.parallel_tool_calls is not False

    def response(status: str, result: SequenceResult | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": rid, "object": "response", "created_at": created, "model": state.served_model_name,
            "status": status, "output": [], "parallel_tool_calls": parallel,
            "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
            "tools": [_response_tool(t) for t in body.tools or []], "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "metadata": body.metadata or {},
            "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
            "incomplete_details": None, "error": None, "usage": None,
        }  # fmt: skip
        if result is None:
            return out
        out["output"] = output_items(msg_id, result.text, tools, parallel)
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
        parser = ChatReplyParser(None, True, parallel) if tools else None
        sent: list[str] = []  # the message text streamed so far (calls held back)

        def render(_: int, out: TextOutput) -> str | None:
            text = out.text
            if parser is not None:
                text = parser.feed(out.text).get("content", "")
                if out.finished:
                    text += parser.finish()[0].get("content", "")
            sent.append(text)
            chunk = event("response.output_text.delta", **where, delta=text, logprobs=[])
            chunk = chunk if text else ""
            if not out.finished:
                return chunk or None
            done = response("completed", results[0])
            message = _item(msg_id, "completed", "".join(sent))
            calls = [item for item in done["output"] if item["type"] == "function_call"]
            done["output"] = [message, *calls]  # as streamed: the message item comes first
            chunk += (
                event("response.output_text.done", **where, text=message["content"][0]["text"],
                      logprobs=[])
                + event("response.content_part.done", **where, part=message["content"][0])
                + event("response.output_item.done", output_index=0, item=message)
            )  # fmt: skip
            for index, call in enumerate(calls, start=1):
                at = {"item_id": call["id"], "output_index": index}
                chunk += (
                    event("response.output_item.added", output_index=index,
                          item={**call, "arguments": "", "status": "in_progress"})
                    + event("response.function_call_arguments.delta", **at, delta=call["arguments"])
                    + event("response.function_call_arguments.done", **at,
                            arguments=call["arguments"])
                    + event("response.output_item.done", output_index=index, item=call)
                )  # fmt: skip
            end = "incomplete" if done["status"] == "incomplete" else "completed"
            return chunk + event(f"response.{end}", response=done)

        def failed(_: int, error: str) -> str:
            return event("response.failed", response={**response("failed", None),
                         "error": {"code": "server_error", "message": error}})  # fmt: skip

        async for data in sse_stream(group, first, results, render, failed):
            yield data

    return await respond(request, group, body.stream, stream, full)


def output_items(
    msg_id: str, text: str, tools: bool, parallel_tool_calls: bool = True
) -> list[dict[str, Any]]:
    """A whole reply as output items: its message (if any text), then its function calls;
    ``parallel_tool_calls`` false keeps only the first call (the chat rule, chat_reply.py)."""
    if not tools:
        return [_item(msg_id, "completed", text)]
    message, calls = ChatReplyParser(None, True, parallel_tool_calls).whole(text)
    items = [_item(msg_id, "completed", message["content"])] if message["content"] else []
    return items + [_function_call(c) for c in calls]


def _function_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
            "name": fn["name"], "arguments": fn["arguments"], "status": "completed"}  # fmt: skip


def _response_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "name": tool["name"], "parameters": tool.get("parameters"),
            "strict": bool(tool.get("strict")), "description": tool.get("description")}  # fmt: skip


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _item(msg_id: str, status: str, text: str) -> dict[str, Any]:
    return {"id": msg_id, "type": "message", "status": status, "role": "assistant",
            "content": [_part(text)]}  # fmt: skip
