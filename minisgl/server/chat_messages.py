"""The messages of a chat request (OpenAI's shape), and how chat templates take them."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel

from minisgl.ipc.messages import JSONDict


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[JSONDict] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def as_dict(self) -> JSONDict:
        """The message as chat templates take it: text content; earlier calls with their
        arguments as objects (templates serialise them; OpenAI sends JSON strings)."""
        out: JSONDict = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def _template_call(call: JSONDict) -> JSONDict:
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise ValueError("tool_calls must be objects with a 'function' object")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise ValueError("tool_calls must carry function.arguments as JSON") from None
    return {**call, "function": {**fn, "arguments": args}}
