"""Finish conditions: EOS, stop token ids, stop strings, stop regexes, max_tokens, context
length; and the tokenizer that stop strings and regexes are decoded with."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from minisgl.scheduler.request import Req
from minisgl.tokenizer import Tokenizer
from minisgl.tokenizer.detokenize import IncrementalDetokenizer
from minisgl.tokenizer.stop_regex import StopRegexFilter


class TokenizerDecoder:
    """The tokenizer that stop strings and regexes are decoded with (structured output builds
    its vocabulary tables from it too), given or loaded on first use: a server's scheduler
    loads it only if a request needs it. Its ``tokenizer`` is None where the model has none;
    then no text is checked."""

    def __init__(
        self, tokenizer: Tokenizer = None, load: Callable[[], Tokenizer] | None = None
    ) -> None:
        self._tokenizer, self._load = tokenizer, load

    @property
    def loaded(self) -> bool:
        return self._load is None

    @property
    def tokenizer(self) -> Tokenizer:
        if self._load is not None:
            self._tokenizer, self._load = self._load(), None
        return self._tokenizer

    def __call__(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))


class StopChecker:
    def __init__(self, eos_ids: Sequence[int], decode: TokenizerDecoder | None) -> None:
        self.eos_ids = frozenset(eos_ids)
        self.decode = decode

    def check(self, req: Req, context_length: int) -> str | None:
        """Returns the finish reason after the request's newest token, or None to go on."""
        p = req.params
        tok = req.output_ids[-1]
        n_out = len(req.output_ids)
        checked = n_out >= p.min_tokens
        decode = self.decode if p.stop or p.stop_regex else None
        if decode is not None and decode.tokenizer is None:
            decode = None  # no tokenizer, no text to check
        if checked:
            if not p.ignore_eos and tok in self.eos_ids:
                req.matched_stop = tok
                return "stop"
            if p.stop_token_ids and tok in p.stop_token_ids:
                req.matched_stop = tok
                return "stop"
            if p.stop and decode is not None:
                stops = p.stop if isinstance(p.stop, (list, tuple)) else [p.stop]
                longest = max(len(s) for s in stops)
                # A stop string ends in the newest tokens; decode just enough of the tail.
                tail = decode(req.output_ids[-(longest + 2) :])
                for s in stops:
                    if s in tail:
                        req.matched_stop = s
                        return "stop"
        # Fed before min_tokens too (unchecked): a match may only begin in text that follows.
        if p.stop_regex and decode is not None and self._regex_matched(req, decode, checked):
            return "stop"
        # Known tokens only: with overlap a token may be in flight, and it is still to come.
        if n_out >= p.max_new_tokens or req.num_known >= context_length:
            return "length"
        return None

    @staticmethod
    def _regex_matched(req: Req, decode: TokenizerDecoder, checked: bool) -> bool:
        """Decode the request's new tokens and search them; True if a stop regex matched."""
        state = req.stop_regex
        if state is None:
            state = req.stop_regex = _RegexState(decode.tokenizer, req)
        assert isinstance(state, _RegexState)
        matcher = state.feed(req.output_ids, checked)
        if matcher.matched is None:
            return False
        req.matched_stop = matcher.matched
        return True


class _RegexState:
    """A request's output text, decoded incrementally as the worker decodes it (the same
    detokenizer, with the request's skip_special_tokens), and its stop_regex matcher."""

    def __init__(self, tokenizer: Tokenizer, req: Req) -> None:
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
