"""Stop conditions given as regular expressions (SGLang's ``stop_regex``).

One pure, per-request matcher serves both sides: the scheduler feeds it each new token's text
to decide where generation ends, and the detokenizer worker feeds it the streamed text to hold
back what may still become part of a match and to cut the output at the match.

Semantics: the patterns are searched in the text generated so far, and it grows character by
character as far as the result is concerned: generation stops at the first prefix of the text
that contains a match, and the output is cut where that match starts. This is a function of
the whole text, so it does not depend on how the text arrives (token by token, or in bigger
pieces). ``$``, ``\\b`` and lookaheads see the end of the text generated so far. The match is
reported by its pattern, as given (SGLang's ``matched_stop`` for a regex: the pattern, not
the matched text).

The third-party ``regex`` module (a dependency of transformers, so always present) is used
instead of ``re`` for its partial matching: it tells where a match could still begin once
more text arrives, which is exactly how much text streaming must hold back. ``re`` cannot
answer that for patterns whose matches have no length bound. Partial matching takes a word
edge at the end of the text as it is there (false after a space), so patterns with word edges
are asked through a relaxed copy; where even that cannot tell (an end assertion under a
negation, a conditional), nothing is released before the end. tests/unit/tokenizer/test_stop_regex.py
checks all of it against the definition, for every way of splitting a text.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import regex

# Assertions whose value can change when more text follows the end (they look at the next
# character, or at the end itself). Detected in the source textually, which errs on the safe
# side: an escaped ``\\$`` only costs a slower path.
_END_ASSERTIONS = ("$", "\\Z", "\\b", "\\B", "\\m", "\\M")
# Word edges: their value at the end is not final, and ``regex``'s partial matching takes it
# as it is there (for ``\\M`` it also misses the leftmost partial match: ".*?\\M" in " "
# reports one at 1, though " 1" matches from 0), so partial searches use a relaxed copy.
_WORD_EDGES = "bBmM"
_POSSESSIVE = ("*+", "++", "?+", "}+", "(?>")


@dataclass(frozen=True)
class StopPattern:
    """A compiled stop regex and what the matcher needs to know about it."""

    pattern: str
    compiled: regex.Pattern[str]
    # A prefix of a text can hold a match the text does not ("x(?!y)" in "ax" and "axy"):
    # look for the first match character by character, not once per piece of new text.
    end_sensitive: bool
    # For the hold-back: the pattern whose partial matches tell where a match could still
    # begin, or None when that cannot be told (nothing is released until the end).
    partial: regex.Pattern[str] | None


@functools.lru_cache(maxsize=1024)
def compile_stop_regex(pattern: str) -> StopPattern:
    """The compiled pattern; ValueError naming ``stop_regex`` if it is not valid, or if it
    matches the empty text (it would stop every request before its first character)."""
    try:
        compiled = regex.compile(pattern)
    except (regex.error, ValueError, TypeError, OverflowError) as exc:
        raise ValueError(
            f"stop_regex must be valid regular expressions: {pattern!r}: {exc}"
        ) from None
    if compiled.search("") is not None:
        raise ValueError(f"stop_regex must not match the empty text, got {pattern!r}")
    if compiled.flags & regex.REVERSE:
        raise ValueError(f"stop_regex must search forwards, got {pattern!r}")
    end_assertion = any(a in pattern for a in _END_ASSERTIONS)
    negative = "(?!" in pattern or "(?<!" in pattern
    # A possessive or atomic run takes what is there up to the end and never gives back, so
    # what follows it sees the end too: "(.*+)(?<=a)" holds in "a" and not in "ab".
    possessive = any(q in pattern for q in _POSSESSIVE)
    partial = compiled
    if "(?(" in pattern or (negative and end_assertion):
        # Under a negation an end assertion turns the other way round; conditionals likewise.
        partial = None
    elif any(f"\\{c}" in pattern for c in _WORD_EDGES):
        partial = _relaxed(pattern, compiled.flags)
    sensitive = end_assertion or negative or possessive or "(?(" in pattern
    return StopPattern(pattern, compiled, sensitive, partial)


def _relaxed(pattern: str, flags: int) -> regex.Pattern[str] | None:
    """The pattern with each word-edge assertion also true at the end of the text (where the
    next character is not known yet), and one more character of anything after it: a partial
    match of that is a position where the original may still match. None if not buildable."""
    if flags & regex.VERBOSE:
        return None  # comments would hide the structure from the scan below
    out: list[str] = []
    i, n = 0, len(pattern)
    in_class, class_body = False, 0
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            pair = pattern[i : i + 2]
            # Inside a character class "\\b" is a backspace, not an assertion.
            edge = not in_class and pair[1] in _WORD_EDGES
            out.append(f"(?:{pair}|\\Z)" if edge else pair)
            i += 2
            continue
        if in_class:
            in_class = not (c == "]" and i > class_body)  # "[]...]": a leading "]" is literal
        elif c == "[":
            in_class = True
            class_body = i + 2 if pattern[i + 1 : i + 2] == "^" else i + 1
        out.append(c)
        i += 1
    try:
        return regex.compile("(?:" + "".join(out) + ")[\\s\\S]", flags)
    except regex.error:
        return None


class StopRegexFilter:
    """Finds the first stop-regex match in a growing text and releases only text that can
    never be part of one. After a match, ``matched`` is the pattern (as given) and ``cut``
    the match's start in the text; nothing from there on is ever released."""

    def __init__(self, patterns: Sequence[str]) -> None:
        self.patterns = [compile_stop_regex(p) for p in patterns]
        # The whole text is kept: lookbehinds may look back past the released part.
        self.text = ""
        self.start = 0  # no match can begin before this index
        self.released = 0  # text[:released] has been returned
        self.matched: str | None = None
        self.cut: int | None = None

    def feed(self, text: str, check: bool = True) -> str:
        """Add text; return what can be released. After a match, nothing more is released.

        ``check=False`` adds the text unexamined and releases it (stop conditions do not apply
        before ``min_tokens``): no match may begin in it, though lookbehinds still see it."""
        if self.matched is not None:
            return ""
        old = len(self.text)
        self.text += text
        end = len(self.text)
        if not check or not self.patterns:
            self.start = end
            return self._release(end)
        hit = self._first_match(old, end)
        if hit is not None:
            self.cut, self.matched = hit
            return self._release(self.cut)
        self.start = min(self._could_begin(p, end) for p in self.patterns)
        return self._release(self.start)

    def flush(self) -> str:
        """The request is over without a match: release the rest."""
        if self.matched is not None:
            return ""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        out = self.text[self.released : upto]
        self.released = max(self.released, upto)
        return out

    def _first_match(self, old: int, end: int) -> tuple[int, str] | None:
        """(match start, pattern) for the shortest prefix ``text[:L]``, old < L <= end, that
        holds a match; among patterns matching at the same L, the earliest start, then the
        first pattern. No prefix up to ``old`` held a match (else we had stopped)."""
        best: tuple[int, int, int] | None = None  # (L, start, pattern index)
        for i, p in enumerate(self.patterns):
            found = self._first_prefix(p, old, end)
            if found is not None and (best is None or (*found, i) < best):
                best = (*found, i)
        return None if best is None else (best[1], self.patterns[best[2]].pattern)

    def _first_prefix(self, p: StopPattern, old: int, end: int) -> tuple[int, int] | None:
        """(L, match start) for the shortest prefix text[:L] (old < L <= end) that ``p`` finds a
        match in, searching from ``start`` (an ``endpos`` search sees the text as if it ended
        there, ``$`` included)."""
        text, pos, search = self.text, self.start, p.compiled.search
        if p.end_sensitive:
            for n in range(old + 1, end + 1):
                m = search(text, pos, n)
                if m is not None:
                    return n, m.start()
            return None
        m = search(text, pos, end)
        if m is None:
            return None
        # A match found in text[:n] is found in every longer prefix: bisect for the first such
        # n (no extra search when the new text is one character, log2 of its length else).
        lo, hi = old + 1, end
        while lo < hi:
            mid = (lo + hi) // 2
            mm = search(text, pos, mid)
            if mm is not None:
                hi, m = mid, mm
            else:
                lo = mid + 1
        return hi, m.start()

    def _could_begin(self, p: StopPattern, end: int) -> int:
        """The earliest index where a match of ``p`` could still begin once more text arrives
        (``end`` if nowhere). Called only when the text holds no match. ``regex`` answers with
        a full match when it finds one, else the leftmost partial match (one that runs into
        the end of the text)."""
        if p.partial is None:
            return self.start
        m = p.partial.search(self.text, self.start, end, partial=True)
        if m is None:
            return end
        if not m.partial:
            return self.start  # a full match may hide a partial one further left: unknown
        return int(m.start())
