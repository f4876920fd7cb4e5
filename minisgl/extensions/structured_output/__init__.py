"""Structured output: sampling constrained to a JSON schema, a regular expression or an EBNF
grammar, through xgrammar (the optional extra ``minisgl[grammar]``), and on the chat routes
tool calling and reasoning parsers.

- Scheduler side: a `ConstraintBackend` (minisgl/scheduler/plugins.py; grammar.py here).
- Server side: tool calls and the thinking of reasoning models (chat.py, through the core's
  chat hook), and the ``--reasoning-parser`` flag."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from minisgl.config import OptionGroup, register_options
from minisgl.extensions.structured_output.chat import ReasoningOptions, ToolsAndReasoning
from minisgl.scheduler.plugins import register_constraints
from minisgl.server.chat_hooks import register_chat_hook

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine
    from minisgl.scheduler.plugins import ConstraintBackend


def make_constraints(engine: Engine, tokenizer: Callable[[], object]) -> ConstraintBackend:
    from minisgl.extensions.structured_output.grammar import GrammarBackend

    cfg = engine.model_config
    return GrammarBackend(tokenizer, cfg.vocab_size, cfg.eos_token_ids)


register_constraints(make_constraints)
register_options(OptionGroup("reasoning", ReasoningOptions, server=True))
register_chat_hook(ToolsAndReasoning.for_server)
