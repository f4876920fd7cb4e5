"""Finish conditions: EOS, stop token ids, stop strings, stop regexes, max_tokens, context
length; and the `decode` that the server's scheduler processes check stop strings with."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from minisgl.scheduler.request import Req
from minisgl.tokenizer.detokenize import IncrementalDetokenizer
from minisgl.tokenizer.stop_regex import StopRegexFilter


class StopChecker:
    def __init__(self, eos_ids: Sequence[int], decode: Callable[[list[int]], str] | None) -> None:
        self.eos_ids = frozenset(eos_ids)
        self.decode = decode

    def check(self, req: Req, context_length: int) -> str | None:
        """Returns the finish reason after the request's newest token, or None to go on."""
        p = req.params
        tok = req.output_ids[-1]
        n_out = len(req.output_ids)
        checked = n_out >= p.min_tokens
        if checked:
            if not p.ignore_eos and tok in self.eos_ids:
                req.matched_stop = tok
                return "stop"
            if p.stop_token_ids and tok in p.stop_token_ids:
                req.matched_stop = tok
                return "stop"
            if p.stop and self.decode is not None:
                stops = p.stop if isinstance(p.stop, (list, tuple)) else [p.stop]
                longest = max(len(s) for s in stops)
                # A stop string ends in the newest tokens; decode just enough of the tail.
                tail = self.decode(req.output_ids[-(longest + 2) :])
                for s in stops:
                    if s in tail:
                        req.matched_stop = s
                        return "stop"
        # Fed before min_tokens too (unchecked): a match may only begin in text that follows.
        if p.stop_regex and self.decode is not None and self._regex_matched(req, checked):
            return "stop"
        # Known tokens only: with overlap a token may be in flight, and it is still to come.
        if n_out >= p.max_new_tokens or req.num_known >= context_length:
            return "length"
        return None

    def _regex_matched(self, req: Req, checked: bool) -> bool:
        """Decode the request's new tokens and search them; True if a stop regex matched."""
        assert self.decode is not None
        state = req.stop_regex
        if state is None:
            state = req.stop_regex = _RegexState(self.decode, req)
        assert isinstance(state, _RegexState)
        matcher = state.feed(req.output_ids, checked)
        if matcher.matched is None:
            return False
        req.matched_stop = matcher.matched
        return True


class _RegexState:
    """A request's output text, decoded incrementally as the worker decodes it (the same
    detokenizer, with the request's skip_special_tokens), and its stop_regex matcher."""

    def __init__(self, decode: Callable[[list[int]], str], req: Req) -> None:
        # A bare callable (no tokenizer behind it) stands in for one: its decoding is the text.
        tokenizer = tokenizer_of(decode) or _DecodeOnly(decode)
        self.detok = IncrementalDetokenizer(tokenizer, req.params.skip_special_tokens)
        self.matcher = StopRegexFilter(req.params.stop_regexes)
        self.fed = 0  # output tokens decoded so far

    def feed(self, output_ids: list[int], checked: bool) -> StopRegexFilter:
        self.matcher.feed(self.detok.add(output_ids[self.fed :]), check=checked)
        self.fed = len(output_ids)
        return self.matcher


def regex_cut(req: Req) -> int | None:
    """Where the request's output text is cut if a stop regex ended it, else None. The text
    is that of ``decode(output_ids, skip_special_tokens)``, of which the matcher saw a prefix."""
    state = req.stop_regex
    if isinstance(state, _RegexState) and state.matcher.matched is not None:
        return state.matcher.cut
    return None


class _DecodeOnly:
    """A ``decode`` callable in the shape of a tokenizer (it decides about special tokens)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._decode(list(ids))


class TokenizerDecoder:
    """``decode`` over a tokenizer already loaded (or None: decodes to "")."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def __call__(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))


def tokenizer_of(decode: Callable[[list[int]], str] | None) -> Any:
    """The tokenizer behind a scheduler's ``decode`` (loaded now if it loads lazily), or None.
    Structured output builds its vocabulary tables from it."""
    get = getattr(decode, "get_tokenizer", None)
    return get() if get is not None else None


class StopStringDecoder:
    """``decode`` for the scheduler's stop-string check, loaded lazily from the tokenizer copy
    the worker saves. Requests reach the scheduler only through the worker, which saves the
    copy before it handles any message, so the copy exists by the time it is needed."""

    def __init__(self, copy_dir: str) -> None:
        self.copy_dir = Path(copy_dir)
        self.tokenizer: Any = None

    def preload(self) -> None:
        if self.tokenizer is None and self.copy_dir.is_dir():
            self._load()

    def _load(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.copy_dir))

    def get_tokenizer(self) -> Any:
        if self.tokenizer is None:
            self._load()
        return self.tokenizer

    def __call__(self, ids: list[int]) -> str:
        return str(self.get_tokenizer().decode(ids, skip_special_tokens=True))


class LazyDecoder:
    """``decode`` for stop strings; loads the tokenizer only if a request uses them."""

    def __init__(self, resolved: Any, override: str | None) -> None:
        self.resolved, self.override = resolved, override
        self.tokenizer: Any = None

    def get_tokenizer(self) -> Any:
        if self.tokenizer is None:
            from minisgl.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(self.resolved, self.override)
        return self.tokenizer

    def __call__(self, ids: list[int]) -> str:
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            return ""
        return str(tokenizer.decode(ids, skip_special_tokens=True))
