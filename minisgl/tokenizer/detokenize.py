"""Streaming text from token ids: incremental detokenization and stop-string hold-back.

Both pieces are pure and per request, so the detokenizer worker and the in-process shell share
them, and they are unit-tested without any model.
"""

from __future__ import annotations

from collections.abc import Sequence

from minisgl.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding token by token breaks in two ways: a multi-byte UTF-8 character split across
    tokens decodes to U+FFFD halves, and SentencePiece-style tokenizers drop the leading space
    of the first token decoded. So each step decodes a short window that starts one committed
    segment back: the delta is the window's text minus the text of its committed prefix, and
    nothing is committed while the window ends in U+FFFD (an unfinished character).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: beginning of the last committed segment
        self.read_offset = 0  # end of the committed tokens

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))

    def _delta(self, final: bool) -> str:
        if self.read_offset >= len(self.ids):
            return ""
        committed = self._decode(self.ids[self.prefix_offset : self.read_offset])
        window = self._decode(self.ids[self.prefix_offset :])
        if len(window) <= len(committed) or (not final and window.endswith(REPLACEMENT_CHAR)):
            return ""  # nothing visible yet, or a character is still incomplete
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return window[len(committed) :]

    def add(self, new_ids: Sequence[int]) -> str:
        """Append tokens; return the text that became final."""
        self.ids.extend(new_ids)
        return self._delta(final=False)

    def flush(self) -> str:
        """The request is over: release held-back text even if a character is incomplete."""
        return self._delta(final=True)


class StopStringFilter:
    """Holds back streamed text that could be the beginning of a stop string, and cuts the
    text at the first complete stop string (which itself is never released)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""  # text received but not yet released
        self.matched: str | None = None

    def _held_back(self) -> int:
        """Length of the longest suffix of ``pending`` that is a proper prefix of a stop."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(stop[:k]):
                    best = k
                    break
        return best

    def feed(self, text: str, check: bool = True) -> str:
        """Add text; return what can be released. After a match, nothing more is released.

        ``check=False`` releases everything unexamined (stop strings do not apply before
        ``min_tokens``, matching the scheduler's rule)."""
        if self.matched is not None:
            return ""
        self.pending += text
        if not self.stops or not check:
            out, self.pending = self.pending, ""
            return out
        # Released text never ends in a partial stop, so a stop can only start in `pending`.
        hits = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            # The stop that completes first wins, as when text arrives token by token.
            cut, self.matched = min(hits, key=lambda h: (h[0] + len(h[1]), h[0]))
            out, self.pending = self.pending[:cut], ""
            return out
        keep = self._held_back()
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        """The request is over without a stop string in the text: release the rest."""
        out, self.pending = ("" if self.matched is not None else self.pending), ""
        return out
