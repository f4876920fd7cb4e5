"""The chat hook (minisgl/server/chat_hooks.py) of tool calling and reasoning parsers, and
the server flag that picks a reasoning parser."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from minisgl.config import option
from minisgl.extensions.structured_output.chat_reply import ChatReplyParser
from minisgl.extensions.structured_output.reasoning import END as THINK_END
from minisgl.extensions.structured_output.reasoning import PARSERS
from minisgl.extensions.structured_output.tool_calls import call_grammar, check_tools
from minisgl.server.args import ServerArgs
from minisgl.server.chat_hooks import ChatTools, Constraint


@dataclass(frozen=True)
class ReasoningOptions:
    reasoning_parser: str | None = option(
        None,
        f"chat replies: put the model's thinking (<think>...</think>) in reasoning_content "
        f"({' | '.join(PARSERS)})",
    )

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None and self.reasoning_parser not in PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(PARSERS)}, "
                f"got {self.reasoning_parser!r}"
            )


class ToolsAndReasoning:
    """Tools: checked, forced calls constrained by a grammar, replies parsed for calls.
    Reasoning (with a parser): the thinking split off into reasoning_content, and a grammar
    (response_format, ..., a forced call) waits for the end of the thinking while the
    template lets the model think."""

    def __init__(self, reasoning_parser: str | None = None) -> None:
        self.reasoning_parser = reasoning_parser

    @classmethod
    def for_server(cls, args: ServerArgs) -> ToolsAndReasoning:
        return cls(args.ext(ReasoningOptions).reasoning_parser)

    def check(self, chat: ChatTools) -> None:
        check_tools(chat.tools, chat.tool_choice)

    def constrain(self, chat: ChatTools, constraint: Constraint) -> Constraint:
        call = call_grammar(chat.tools, chat.tool_choice) if chat.tools else None
        if call is not None:
            if constraint.has_grammar:
                raise ValueError(
                    "tool_choice must be 'auto' or 'none' when the output format is constrained"
                )
            constraint = Constraint(ebnf=call)
        if self.reasoning_parser is not None and chat.thinking and constraint.has_grammar:
            constraint = dataclasses.replace(constraint, grammar_after=THINK_END)
        return constraint

    def reply_parser(self, chat: ChatTools) -> ChatReplyParser | None:
        reasoning = self.reasoning_parser if chat.separate_reasoning else None
        if reasoning is None and not chat.uses_tools:
            return None
        return ChatReplyParser(reasoning, chat.uses_tools, chat.parallel_tool_calls)
