"""Per-request sampling parameters (OpenAI / vLLM / SGLang conventions).

One frozen object from where a request is made (an HTTP route, or offline code) to the
scheduler, validated once, when it is built (`__post_init__`): every later stage trusts it.
A changed copy is made with `dataclasses.replace` (validated again) or, for changes that
cannot make a valid object invalid, with `for_choice` / `with_max_tokens`.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass

# OpenAI caps `top_logprobs` at 20; the sampler sizes a [B, K] top-k by it.
MAX_TOP_LOGPROBS = 20
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")
# What `max_new_tokens` reads for max_tokens None: no limit of its own, the context decides.
UNLIMITED = 2**62


def _bad(field: str, value: object, rule: str) -> ValueError:
    # One message shape everywhere: the field, its value, and what was expected.
    return ValueError(f"{field} must be {rule}, got {value!r}")


def _int_or_zero(value: object) -> int:
    return value if isinstance(value, int) else 0


def _as_list(value: object) -> list[object]:
    """None -> [], one value -> [it], a list or tuple -> a list (a copy)."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 means off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # None: as many as the context allows. The API server sends None when a request gives no
    # limit; its scheduler process resolves it to the room the prompt leaves
    # (`with_max_tokens`). Offline, None lets generation run to the end of the context.
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    # Normalised by __post_init__ to a list of non-empty strings (None -> []).
    stop: str | list[str] | None = None
    # Normalised by __post_init__ to a list (None -> []).
    stop_token_ids: list[int] | None = None
    # Regular expressions (SGLang's stop_regex; normalised like `stop`): generation stops at
    # the first match in the generated text, which is cut where the match starts.
    stop_regex: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool = False  # return the chosen token's logprob
    top_logprobs: int = 0  # how many alternatives to return per position
    # vLLM's meaning: None = off; k >= 0 = each prompt token's logprob plus k alternatives.
    # Such a request skips the prefix cache (cached tokens have no logits to report).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    n: int = 1
    # Structured output (SGLang's names; at most one): the output must match a JSON schema
    # (a JSON string), a regular expression, or an EBNF grammar (GBNF syntax). Needs the
    # optional package xgrammar (minisgl/extensions/structured_output/grammar.py).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # Reasoning models: the grammar applies only once the output has ended with this text's
    # tokens (e.g. "</think>"); the output before is free (the model's thinking). A prompt
    # that already ends with them (then whitespace only) is constrained from the first token.
    # The server sets it for chat requests under a reasoning parser (server/chat_hooks.py).
    grammar_after: str | None = None

    def __post_init__(self) -> None:
        # Frozen: the normalised values are set the way dataclasses' own __init__ sets them.
        object.__setattr__(self, "stop", _as_list(self.stop))
        object.__setattr__(self, "stop_token_ids", _as_list(self.stop_token_ids))
        object.__setattr__(self, "stop_regex", _as_list(self.stop_regex))
        self._check()

    # ------------------------------------------------------------ copies
    def _evolve(self, **changes: object) -> SamplingParams:
        # copy.copy of a dataclass does not call __init__: the copy is not validated again.
        new = copy.copy(self)
        for name, value in changes.items():
            object.__setattr__(new, name, value)
        return new

    def for_choice(self, index: int) -> SamplingParams:
        """Choice ``index`` of an n > 1 request: one sequence of its own (n=1), with seed +
        index, so that seeded choices differ and stay reproducible. Not validated again:
        neither change can make a valid object invalid (the server keeps seeds in range)."""
        seed = self.seed + index if self.seed is not None else None
        return self._evolve(n=1, seed=seed)

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        """A copy with max_tokens set (the server's None resolved to the room the prompt
        leaves); ValueError naming min_tokens if it asks for more than that."""
        if self.min_tokens > max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"in [0, max_tokens={max_tokens}]")
        return self._evolve(max_tokens=max_tokens)

    # ------------------------------------------------------------ derived views
    @property
    def max_new_tokens(self) -> int:
        """max_tokens as the scheduler counts it: None means no limit but the context's."""
        return UNLIMITED if self.max_tokens is None else self.max_tokens

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple, typed without the pre-normalisation `str` case."""
        return tuple(self.stop or ())  # a list once built

    @property
    def stop_regexes(self) -> tuple[str, ...]:
        """`stop_regex` as a tuple, typed without the pre-normalisation `str` case."""
        return tuple(self.stop_regex or ())  # a list once built

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(field, text) of the structured-output constraint, or None."""
        for name in GRAMMAR_FIELDS:
            text = getattr(self, name)
            if text is not None:
                return name, text
        return None

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    # ------------------------------------------------------------ validation
    def _check(self) -> None:
        """Raise ValueError naming the first bad field and its value."""
        self._check_sampling()
        self._check_lengths()
        for s in self.stop_strings:
            if not isinstance(s, str) or not s:
                raise _bad("stop", self.stop, "non-empty strings")
        for t in self.stop_token_ids or ():
            if not isinstance(t, int) or t < 0:
                raise _bad("stop_token_ids", self.stop_token_ids, "non-negative integers")
        self._check_stop_regex()
        if self.seed is not None and not isinstance(self.seed, int):
            raise _bad("seed", self.seed, "an integer or None")
        self._check_grammar()

    def _check_sampling(self) -> None:
        # Written as `not (ok)` so that NaN, which fails every comparison, is rejected.
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise _bad("temperature", self.temperature, "a finite number >= 0")
        if not (0 < self.top_p <= 1):
            raise _bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise _bad("top_k", self.top_k, "an integer >= -1 (-1 or 0 disables it)")
        if not (0 <= self.min_p <= 1):
            raise _bad("min_p", self.min_p, "in [0, 1]")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise _bad("repetition_penalty", self.repetition_penalty, "a finite number > 0")
        if not (-2 <= self.frequency_penalty <= 2):
            raise _bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not (-2 <= self.presence_penalty <= 2):
            raise _bad("presence_penalty", self.presence_penalty, "in [-2, 2]")

    def _check_lengths(self) -> None:
        max_tokens = self.max_tokens
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise _bad("max_tokens", max_tokens, "an integer >= 1")
        # With max_tokens None the limit is known later (with_max_tokens checks it then).
        most = max_tokens if max_tokens is not None else max(1, _int_or_zero(self.min_tokens))
        if not isinstance(self.min_tokens, int) or not (0 <= self.min_tokens <= most):
            raise _bad("min_tokens", self.min_tokens, f"in [0, max_tokens={most}]")
        if not isinstance(self.top_logprobs, int) or not (
            0 <= self.top_logprobs <= MAX_TOP_LOGPROBS
        ):
            raise _bad("top_logprobs", self.top_logprobs, f"in [0, {MAX_TOP_LOGPROBS}]")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int)
            or not (0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS)
        ):
            raise _bad(
                "prompt_logprobs", self.prompt_logprobs, f"None or in [0, {MAX_TOP_LOGPROBS}]"
            )
        if not isinstance(self.n, int) or self.n < 1:
            raise _bad("n", self.n, "an integer >= 1")

    def _check_stop_regex(self) -> None:
        from minisgl.tokenizer.stop_regex import compile_stop_regex

        for pattern in self.stop_regexes:
            if not isinstance(pattern, str) or not pattern:
                raise _bad("stop_regex", self.stop_regex, "non-empty strings")
            compile_stop_regex(pattern)  # compiled once per pattern (cached)

    def _check_grammar(self) -> None:
        given = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(
                f"{given[1]} must not be set together with {given[0]} (one of json_schema, "
                "regex and ebnf at most)"
            )
        after = self.grammar_after
        if after is not None:
            if not isinstance(after, str) or not after:
                raise _bad("grammar_after", after, "None or a non-empty string")
            if not given:
                raise ValueError("grammar_after requires json_schema, regex or ebnf")
        if not given:
            return
        name = given[0]
        text = getattr(self, name)
        if not isinstance(text, str) or not text.strip():
            raise _bad(name, text, "a non-empty string")
        if name == "json_schema":
            try:
                schema = json.loads(text)
            except ValueError as e:
                raise ValueError(f"json_schema must be a JSON document: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise _bad("json_schema", text, "a JSON object (a JSON Schema)")
        if self.min_tokens:
            # The grammar may allow nothing but EOS while min_tokens still forbids it.
            raise ValueError(f"min_tokens must be 0 with {name}, got {self.min_tokens}")
