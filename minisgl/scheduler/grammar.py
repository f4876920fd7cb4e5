"""Structured output: sampling constrained to a JSON schema, a regular expression or an EBNF
grammar, through xgrammar (the optional extra ``minisgl[grammar]``).

Each constrained request owns a matcher (the grammar's state after its output so far). Before
a step samples for it, the matcher fills the request's row of a vocabulary bitmask (1 =
allowed); the engine sets every other logit to -inf before sampling, so penalties, top-k/p
and greedy all choose among allowed tokens. After the step the matcher accepts the token;
once it has accepted a stop token (or the grammar admits nothing more) the request ends with
finish reason "stop". The bitmask needs the previous token on the host, so a batch with a
constrained row is not overlapped with the next (scheduler.py).

JSON schemas compile without free whitespace between tokens (compact JSON: ``{"a": 1}``):
with free whitespace a model can emit blank lines forever without breaking the grammar.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch


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

    def bitmask(self, matchers: Sequence[Any | None]) -> torch.Tensor:
        """int32 [len(matchers), ceil(V / 32)]: row i the tokens matcher i allows next (all
        tokens for an unconstrained row, None)."""
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i, m in enumerate(matchers):
            if m is not None:
                m.fill_next_token_bitmask(mask, i)
        return mask
