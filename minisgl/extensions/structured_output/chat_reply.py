"""A chat reply as the OpenAI message carries it: thinking in ``reasoning_content``
(reasoning.py), tool calls in ``tool_calls`` (tool_calls.py), the rest in ``content``. One
parser per choice serves both streamed and whole replies (the core's `ReplyParser`)."""

from __future__ import annotations

from minisgl.extensions.structured_output.reasoning import StreamingReasoningParser
from minisgl.extensions.structured_output.tool_calls import StreamingToolParser
from minisgl.ipc.messages import JSONDict


class ChatReplyParser:
    """``parallel_tool_calls=False`` keeps only the first of the reply's calls (as vLLM does; a
    forced tool_choice's grammar allows one call anyway)."""

    def __init__(
        self, reasoning_parser: str | None, tools: bool, parallel_tool_calls: bool = True
    ) -> None:
        self.reasoning = StreamingReasoningParser(reasoning_parser) if reasoning_parser else None
        self.tools = StreamingToolParser() if tools else None
        self.parallel_tool_calls = parallel_tool_calls

    def feed(self, text: str) -> dict[str, str]:
        """The delta fields this piece of the reply makes certain (possibly none)."""
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        return self._delta(reasoning, content)

    def finish(self) -> tuple[dict[str, str], list[JSONDict]]:
        """(the last delta fields, tool calls) once the reply is complete."""
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        delta = self._delta(reasoning, content)
        calls: list[JSONDict] = []
        if self.tools is not None:
            rest, calls = self.tools.finish()
            if not self.parallel_tool_calls:
                calls = calls[:1]
            if rest:
                delta["content"] = delta.get("content", "") + rest
        return delta, calls

    def _delta(self, reasoning: str, content: str) -> dict[str, str]:
        if self.tools is not None and content:
            content = self.tools.feed(content)
        delta = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        return delta

    def whole(self, text: str) -> tuple[JSONDict, list[JSONDict]]:
        """(message fields, tool calls) of a complete reply."""
        first = self.feed(text)
        last, calls = self.finish()
        content = first.get("content", "") + last.get("content", "")
        message: JSONDict = {"content": content}
        if self.reasoning is not None:
            thought = first.get("reasoning_content", "") + last.get("reasoning_content", "")
            message["reasoning_content"] = thought if self.reasoning.saw_reasoning else None
        if calls:
            message["content"] = content.strip() or None
            message["tool_calls"] = calls
        return message, calls
