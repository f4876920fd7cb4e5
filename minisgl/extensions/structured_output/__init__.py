"""Structured output: sampling constrained to a JSON schema, a regular expression or an EBNF
grammar, through xgrammar (the optional extra ``minisgl[grammar]``). It plugs into the
scheduler as a `ConstraintBackend` (minisgl/scheduler/plugins.py, grammar.py here)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from minisgl.scheduler.plugins import register_constraints

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine
    from minisgl.scheduler.plugins import ConstraintBackend


def make_constraints(engine: Engine, tokenizer: Callable[[], object]) -> ConstraintBackend:
    from minisgl.extensions.structured_output.grammar import GrammarBackend

    cfg = engine.model_config
    return GrammarBackend(tokenizer, cfg.vocab_size, cfg.eos_token_ids)


register_constraints(make_constraints)
