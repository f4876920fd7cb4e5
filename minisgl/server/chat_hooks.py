"""What an extension adds to a chat request: tools and reasoning (the structured_output
extension does both). The chat route (and the Responses route) reach them only through the
one `ChatHook` registered here:

- `check` refuses tools / tool_choice it cannot serve (ValueError naming the field);
- `constrain` turns them into the request's output constraint (a forced tool call's grammar,
  or a grammar that waits for the end of the thinking: ``grammar_after``);
- `reply_parser` splits each choice's reply (whole or streamed) into the message's fields.

Without a registered hook, chat requests that use tools are refused with a 400 naming
``tools``, and replies are plain content.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from minisgl.ipc.messages import JSONDict
from minisgl.server.args import ServerArgs


@dataclass(frozen=True)
class ChatTools:
    """What a chat request says about tools and thinking."""

    tools: list[JSONDict]  # OpenAI function tools ([] when none)
    tool_choice: object  # "none" | "auto" | "required" | {"type": "function", ...} | None
    parallel_tool_calls: bool = True  # false: only the reply's first call is kept
    thinking: bool = True  # the template lets the model think (enable_thinking not false)
    separate_reasoning: bool = True  # thinking goes to reasoning_content (false: content)

    @property
    def uses_tools(self) -> bool:
        """Tools go to the template and the reply is parsed for calls."""
        return bool(self.tools) and self.tool_choice != "none"


@dataclass(frozen=True)
class Constraint:
    """A request's structured-output fields (at most one grammar; SamplingParams checks)."""

    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    grammar_after: str | None = None  # the grammar waits for this text (end of thinking)

    @property
    def has_grammar(self) -> bool:
        return self.json_schema is not None or self.regex is not None or self.ebnf is not None


class ReplyParser(Protocol):
    """One choice's reply as the OpenAI message carries it (fields such as ``content`` and
    ``reasoning_content``, and tool calls), streamed or whole."""

    def feed(self, text: str) -> dict[str, str]:
        """The delta fields this piece of the reply makes certain (possibly none)."""
        ...

    def finish(self) -> tuple[dict[str, str], list[JSONDict]]:
        """(the last delta fields, tool calls) once the reply is complete."""
        ...

    def whole(self, text: str) -> tuple[JSONDict, list[JSONDict]]:
        """(message fields, tool calls) of a complete reply."""
        ...


class ChatHook(Protocol):
    def check(self, chat: ChatTools) -> None: ...

    def constrain(self, chat: ChatTools, constraint: Constraint) -> Constraint: ...

    def reply_parser(self, chat: ChatTools) -> ReplyParser | None: ...


class PlainChat:
    """The core's chat: no tools, no reasoning parser."""

    def check(self, chat: ChatTools) -> None:
        if chat.uses_tools:
            raise ValueError(
                "tools must be empty (or tool_choice 'none'): tool calling is not available "
                "(the structured_output extension is not loaded)"
            )

    def constrain(self, chat: ChatTools, constraint: Constraint) -> Constraint:
        return constraint

    def reply_parser(self, chat: ChatTools) -> ReplyParser | None:
        return None


# Builds the hook of one server from its settings (e.g. the --reasoning-parser flag).
ChatHookFactory = Callable[[ServerArgs], ChatHook]
_factory: list[ChatHookFactory] = []


def register_chat_hook(factory: ChatHookFactory) -> None:
    if _factory:
        raise RuntimeError("a chat hook is registered already: only one extension may add one")
    _factory.append(factory)


def chat_hook(args: ServerArgs | None = None) -> ChatHook:
    """The chat hook for a server started with ``args`` (None: the default settings), the
    extensions loaded first; `PlainChat` when none registered one."""
    from minisgl.extension_loader import load_extensions

    load_extensions()
    return _factory[0](args or ServerArgs()) if _factory else PlainChat()
