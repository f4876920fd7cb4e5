"""Structured output: sampling constrained to a JSON schema, a regular expression or an EBNF
grammar, through xgrammar (the optional extra ``minisgl[grammar]``).

Each constrained request owns a matcher (the grammar's state after its output so far). Before
a step samples for it, the matcher fills the request's row of a vocabulary bitmask (1 =
allowed); the engine sets every other logit to -inf before sampling, so penalties, top-k/p
and greedy all choose among allowed tokens. After the step the matcher accepts the token;
once it has accepted a stop token (or the grammar admits nothing more) the request ends with
finish reason "stop". The bitmask needs the previous token on the host, so a batch with a
constrained row is not overlapped with the next (scheduler.py). It plugs into the scheduler
as a `ConstraintBackend` (minisgl/scheduler/plugins.py).

JSON schemas compile without free whitespace between tokens (compact JSON: ``{"a": 1}``):
with free whitespace a model can emit blank lines forever without breaking the grammar.

Reasoning models (``grammar_after``, e.g. ``"</think>"``): the matcher waits while the model
thinks. Its rows are unconstrained (no bitmask) and it accepts nothing until the output ends
with the marker's tokens (``wait``: only the newest token is compared with the marker's
last, then its tail with the marker); from the next token on it constrains as above.
A prompt that already closed the thinking (Qwen3's template with ``enable_thinking: false``
ends with ``<think>\n\n</think>\n\n``) is constrained from the first token. Waiting rows
still keep their batch from being overlapped: the step after the marker needs the bitmask.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from minisgl.sampling_params import SamplingParams
from minisgl.scheduler.request import Req

logger = logging.getLogger(__name__)

# Whitespace tokens a prompt may end with after ``grammar_after``'s marker and still count
# as having closed the thinking (Qwen3's template: one "\n\n" token).
PROMPT_TAIL_TOKENS = 4


@dataclass
class GrammarState:
    """A request's grammar: its matcher, and the marker tokens it still waits for (() once
    the grammar applies)."""

    matcher: Any
    wait: tuple[int, ...] = ()


class GrammarBackend:
    """Compiles grammars for one tokenizer (lazily: xgrammar and the tokenizer load on the
    first constrained request) and fills bitmasks for a batch of matchers."""

    def __init__(
        self, tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: Sequence[int]
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: Any = None
        self._markers: dict[str, tuple[int, ...]] = {}

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            try:
                import xgrammar as xgr
            except ImportError:
                raise ValueError(
                    "structured output (json_schema, regex, ebnf, response_format) needs the "
                    "optional package xgrammar: pip install 'minisgl[grammar]'"
                ) from None
            tokenizer = self._tokenizer()
            if tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer, and it has none")
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        return self._compiler

    def matcher(self, kind: str, text: str) -> Any:
        """A fresh matcher for ``kind`` (json_schema / regex / ebnf) ``text``; ValueError
        naming the field if it does not compile. Compiled grammars are cached by text."""
        import xgrammar as xgr

        compiler = self._get_compiler()
        try:
            if kind == "json_schema":
                compiled = compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "regex":
                compiled = compiler.compile_regex(text)
            elif kind == "ebnf":
                compiled = compiler.compile_grammar(text)
            else:
                raise ValueError(f"unknown grammar kind {kind!r}")
        except Exception as e:  # noqa: BLE001 - xgrammar raises several types for bad input
            what = {"json_schema": "JSON schema", "regex": "regular expression"}.get(kind, kind)
            # xgrammar prefixes its messages with a time and a C++ source location.
            reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip())
            raise ValueError(f"{kind} must be a valid {what}: {reason}") from None
        return xgr.GrammarMatcher(compiled)

    def marker(self, text: str) -> tuple[int, ...]:
        """``grammar_after``'s token ids: ``text`` encoded on its own, no special tokens (the
        think-end marker of a reasoning model is one added token; cached by text)."""
        ids = self._markers.get(text)
        if ids is None:
            self._get_compiler()  # the tokenizer's checks and messages
            ids = tuple(int(t) for t in self._tokenizer().encode(text, add_special_tokens=False))
            if not ids:
                raise ValueError(f"grammar_after must encode to tokens, got {text!r}")
            self._markers[text] = ids
        return ids

    def wait_for(self, text: str | None, prompt_ids: Sequence[int]) -> tuple[int, ...]:
        """The tokens the output must end with before the grammar applies (``grammar_wait``):
        ``text``'s marker, or () when there is none or the prompt already ends with it (and
        then at most a few whitespace tokens)."""
        if text is None:
            return ()
        ids = self.marker(text)
        n = len(ids)
        tail = list(prompt_ids[-(n + PROMPT_TAIL_TOKENS) :])
        for start in range(len(tail) - n, -1, -1):  # the last occurrence
            if tuple(tail[start : start + n]) == ids:
                rest = tail[start + n :]
                if not rest or not self._tokenizer().decode(rest).strip():
                    return ()
                break
        return ids

    def start(self, params: SamplingParams, prompt_ids: Sequence[int]) -> GrammarState | None:
        grammar = params.grammar
        if grammar is None:
            return None
        matcher = self.matcher(*grammar)
        return GrammarState(matcher, self.wait_for(params.grammar_after, prompt_ids))

    def bitmask(self, states: Sequence[object | None]) -> torch.Tensor | None:
        """int32 [len(states), ceil(V / 32)]: row i the tokens state i allows next (every
        token for a row without a grammar or still waiting for its marker); None if no row
        is constrained now."""
        live = [s.matcher if isinstance(s, GrammarState) and not s.wait else None for s in states]
        if all(m is None for m in live):
            return None
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(len(live), self.vocab_size)
        for i, m in enumerate(live):
            if m is not None:
                m.fill_next_token_bitmask(mask, i)
        return mask

    def advance(self, req: Req, token: int) -> bool:
        """Advance the request's matcher by its new token; True once the grammar is complete
        (it accepted a stop token, or nothing can follow). While the request waits for the
        end of its reasoning the token only counts towards that marker."""
        state = req.constraint
        assert isinstance(state, GrammarState)
        wait = state.wait
        if wait:
            if token == wait[-1] and tuple(req.output_ids[-len(wait) :]) == wait:
                state.wait = ()  # the reasoning ended: the grammar applies from now on
            return False
        if not state.matcher.accept_token(token):
            # Only allowed tokens are sampled; this would be a bug, so end the request visibly.
            logger.error("request %s sampled token %d outside its grammar", req.uid, token)
            return True
        return bool(state.matcher.is_terminated())
