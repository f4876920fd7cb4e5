"""The Responses API's response object, its output items, and its streamed events."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from minisgl.ipc.messages import JSONDict, TextOutput
from minisgl.server.chat_hooks import ReplyParser
from minisgl.server.request_group import RequestGroup, SequenceResult
from minisgl.server.streaming import sse_event, sse_stream

if TYPE_CHECKING:
    from minisgl.extensions.responses.request import ResponsesRequest


def _part(text: str) -> JSONDict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(msg_id: str, status: str, text: str) -> JSONDict:
    return {
        "id": msg_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [_part(text)],
    }


def _function_call(call: JSONDict) -> JSONDict:
    fn = call["function"]
    assert isinstance(fn, dict)
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"],
        "status": "completed",
    }


def _response_tool(tool: object) -> JSONDict:
    fields = tool if isinstance(tool, dict) else {}
    return {
        "type": "function",
        "name": fields.get("name"),
        "parameters": fields.get("parameters"),
        "strict": bool(fields.get("strict")),
        "description": fields.get("description"),
    }


def output_items(msg_id: str, text: str, parser: ReplyParser | None) -> list[JSONDict]:
    """A whole reply as output items: its message (if any text), then its function calls,
    as ``parser`` (a fresh one; None: no tools) finds them."""
    if parser is None:
        return [message_item(msg_id, "completed", text)]
    message, calls = parser.whole(text)
    content = message["content"]  # None or "" when the reply is only calls
    items = (
        [message_item(msg_id, "completed", content)] if isinstance(content, str) and content else []
    )
    return items + [_function_call(c) for c in calls]


class ResponseReply:
    """One response, whole or streamed. ``parsers`` makes a fresh reply parser (the chat
    hook's: it finds the tool calls) or None."""

    def __init__(
        self,
        body: ResponsesRequest,
        model: str,
        parsers: Callable[[], ReplyParser | None],
    ) -> None:
        self.body, self.model, self.parsers = body, model, parsers
        self.id, self.msg_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created = time.time()

    def header(self, status: str) -> JSONDict:
        """The response object before any output."""
        body = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
            "tools": [_response_tool(t) for t in body.tools or []],
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "metadata": body.metadata or {},
            "text": {"format": body.format},
            "incomplete_details": None,
            "error": None,
            "usage": None,
        }

    def done(self, result: SequenceResult, output: list[JSONDict]) -> JSONDict:
        """The response object once ``result`` is complete, with these output items."""
        out = self.header("completed")
        out["output"] = output
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

    def full(self, results: list[SequenceResult]) -> JSONDict:
        result = results[0]
        return self.done(result, output_items(self.msg_id, result.text, self.parsers()))

    async def stream(self, group: RequestGroup, first: TextOutput) -> AsyncIterator[str]:
        events = _Events(self)
        yield events.opening()
        async for data in sse_stream(group, first, events.results, events.render, events.failed):
            yield data


class _Events:
    """The typed events of one streamed response, numbered in order."""

    def __init__(self, reply: ResponseReply) -> None:
        self.reply = reply
        self.seq = itertools.count()
        self.where: JSONDict = {"item_id": reply.msg_id, "output_index": 0, "content_index": 0}
        self.results = [SequenceResult()]
        self.parser = reply.parsers()
        self.sent: list[str] = []  # the message text streamed so far (calls held back)

    def event(self, kind: str, **data: object) -> str:
        return sse_event(kind, {"sequence_number": next(self.seq), **data})

    def opening(self) -> str:
        started = self.reply.header("in_progress")
        item = {**message_item(self.reply.msg_id, "in_progress", ""), "content": []}
        return (
            self.event("response.created", response=started)
            + self.event("response.in_progress", response=started)
            + self.event("response.output_item.added", output_index=0, item=item)
            + self.event("response.content_part.added", **self.where, part=_part(""))
        )

    def render(self, _: int, out: TextOutput) -> str | None:
        text = out.text
        if self.parser is not None:
            text = self.parser.feed(out.text).get("content", "")
            if out.finished:
                text += self.parser.finish()[0].get("content", "")
        self.sent.append(text)
        delta = self.event("response.output_text.delta", **self.where, delta=text, logprobs=[])
        chunk = delta if text else ""
        if not out.finished:
            return chunk or None
        return chunk + self.closing()

    def closing(self) -> str:
        """The events after the last text: the message done, then each call whole."""
        reply, result = self.reply, self.results[0]
        output = output_items(reply.msg_id, result.text, reply.parsers())
        calls = [item for item in output if item["type"] == "function_call"]
        text = "".join(self.sent)
        message = message_item(reply.msg_id, "completed", text)
        # As streamed: the message item comes first.
        done = reply.done(result, [message, *calls])
        chunk = (
            self.event("response.output_text.done", **self.where, text=text, logprobs=[])
            + self.event("response.content_part.done", **self.where, part=_part(text))
            + self.event("response.output_item.done", output_index=0, item=message)
        )
        for index, call in enumerate(calls, start=1):
            chunk += self._call_events(index, call)
        end = "incomplete" if done["status"] == "incomplete" else "completed"
        return chunk + self.event(f"response.{end}", response=done)

    def _call_events(self, index: int, call: JSONDict) -> str:
        at = {"item_id": call["id"], "output_index": index}
        added = {**call, "arguments": "", "status": "in_progress"}
        return (
            self.event("response.output_item.added", output_index=index, item=added)
            + self.event("response.function_call_arguments.delta", **at, delta=call["arguments"])
            + self.event("response.function_call_arguments.done", **at, arguments=call["arguments"])
            + self.event("response.output_item.done", output_index=index, item=call)
        )

    def failed(self, _: int, error: str) -> str:
        failed = self.reply.header("failed")
        failed["error"] = {"code": "server_error", "message": error}
        return self.event("response.failed", response=failed)
