"""stop_regex: the matcher and its streaming hold-back (no model), and the parameter's
validation."""

from __future__ import annotations

import pytest
import regex
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from minisgl import SamplingParams
from minisgl.server.protocol import CompletionRequest, GenerateRequest, param_of
from minisgl.tokenizer.stop_regex import StopRegexFilter


def reference(text: str, patterns: list[str]) -> tuple[str, str | None]:
    """The definition, by brute force: the first prefix of the text that holds a match ends
    generation; the output is cut where that match starts (earliest start, then first pattern,
    among patterns matching in that prefix)."""
    for n in range(1, len(text) + 1):
        hits = [
            (m.start(), i)
            for i, p in enumerate(patterns)
            if (m := regex.search(p, text[:n])) is not None
        ]
        if hits:
            start, i = min(hits)
            return text[:start], patterns[i]
    return text, None


def stream(patterns: list[str], chunks: list[str]) -> tuple[str, str | None]:
    f = StopRegexFilter(patterns)
    out = ""
    for chunk in chunks:
        out += f.feed(chunk)
    out += f.flush()
    return out, f.matched


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


# ---------------------------------------------------------------- the matcher
def test_partial_match_is_held_back_then_cut() -> None:
    f = StopRegexFilter([r"\d+\.\d+"])
    assert f.feed("pi is 3") == "pi is "  # "3" may begin a match
    assert f.feed(".") == ""
    assert f.feed("14 and more") == ""
    assert f.matched == r"\d+\.\d+" and f.cut == len("pi is ")
    assert f.feed("ignored") == "" and f.flush() == ""


def test_held_back_text_is_released_once_it_cannot_match() -> None:
    f = StopRegexFilter([r"\d+\.\d+"])
    assert f.feed("3") == ""
    assert f.feed("x") == "3x"
    assert f.feed(" 7.") == " "
    assert f.flush() == "7."
    assert f.matched is None


def test_unbounded_pattern_holds_back_only_from_where_it_could_start() -> None:
    f = StopRegexFilter([r"<tool>.*</tool>"])
    assert f.feed("plain text <to") == "plain text "
    assert f.feed("ol> args ") == ""
    assert f.feed("</tool> tail") == ""
    assert f.matched == r"<tool>.*</tool>" and f.cut == len("plain text ")


def test_the_match_completed_first_wins_not_the_leftmost() -> None:
    # In "aqz", "q" completes (at 2 characters) before "a.*z" (at 3): text "a", as token by
    # token; a single chunk must give the same.
    assert stream([r"a.*z|q"], ["aqz"]) == ("a", r"a.*z|q")
    assert stream([r"a.*z", "q"], ["aqz"]) == ("a", "q")


def test_end_sensitive_patterns_see_the_end_of_the_text_so_far() -> None:
    # "x" at the end of "ax" is not followed by "y" (yet): that is a match, in whatever pieces.
    assert stream([r"x(?!y)"], ["axy"]) == ("a", r"x(?!y)")
    assert stream([r"x(?!y)"], ["a", "x", "y"]) == ("a", r"x(?!y)")
    assert stream([r"b$"], ["abc"]) == ("a", r"b$")


def test_a_word_edge_at_the_end_is_not_known_yet() -> None:
    # After "1 " the edge "\b" is false (nothing follows) but holds once "1" comes: the space
    # must be held back although regex's own partial matching gives up on it.
    f = StopRegexFilter([r"\s\b"])
    assert f.feed("1 ") == "1"
    assert f.feed("1") == ""
    assert f.matched == r"\s\b" and f.cut == 1


def test_a_possessive_run_sees_the_end() -> None:
    # "(?:a|.*+(?<=a))\1"-like patterns: the run takes everything up to the end, so the
    # shorter text matches where the longer one does not; the shorter one decides.
    assert stream([r"x.*+(?<=x)"], ["ax1"]) == ("a", r"x.*+(?<=x)")


def test_lookbehind_sees_released_text() -> None:
    f = StopRegexFilter([r"(?<=a)b"])
    assert f.feed("xa") == "xa"
    assert f.feed("b") == ""
    assert f.matched == r"(?<=a)b" and f.cut == 2


def test_unchecked_text_passes_through_and_cannot_start_a_match() -> None:
    f = StopRegexFilter([r"ab"])
    assert f.feed("xa", check=False) == "xa"
    assert f.feed("b ab") == "b "
    assert f.matched == "ab" and f.cut == 4


# Patterns built from a small grammar over the texts' alphabet: alternation, repetition (greedy,
# lazy, possessive), groups, classes, backreferences, and the assertions that look at the end
# of the text (word edges, "$", lookarounds, negated ones too), so that each way the matcher
# decides (one search per piece of text, or one per character; partial matches plain or
# relaxed at word edges; holding everything back) is checked against the definition.
_ATOMS = st.sampled_from(
    ["a", "b", "c", "x", ".", "[ab]", "[^a]", r"\s", r"\d", "(?:ab)", " ", r"\w", r"\W",
     "[\\b]", "\n"]
)  # fmt: skip
_SUFFIX = st.sampled_from(["", "", "*", "+", "?", "*?", "+?", "{2}", "{1,2}", "*+", "++"])
_ASSERT = st.sampled_from(
    ["", "", "", r"\b", r"\B", r"\m", r"\M", "$", r"\Z", "^", "(?=a)", "(?!a)", "(?<=a)",
     "(?<!a)", "(?!a$)", r"(?=\b)", r"(?<=\s\b)", r"(?<!\b)", r"(?!\b)", "(?m:$)"]
)  # fmt: skip
_WRAP = st.sampled_from(["{}", "{}", "(?:{})", "(?>{})", "(?i){}", "(?s){}", "(?:{})+", r"({})\1"])


@st.composite
def patterns(draw: st.DrawFn) -> str:
    def sequence(most: int) -> str:
        parts = draw(
            st.lists(st.tuples(_ASSERT, _ATOMS, _SUFFIX, _ASSERT), min_size=1, max_size=most)
        )
        return "".join("".join(part) for part in parts)

    body = sequence(3)
    if draw(st.booleans()):
        body += "|" + sequence(2)
    return draw(_WRAP).format(body)


def _usable(p: str) -> bool:
    """Compiles, and does not match the empty text (compile_stop_regex refuses those)."""
    try:
        return regex.compile(p).search("") is None
    except regex.error:
        return False


@settings(max_examples=1500, deadline=None)
@given(
    text=st.text(alphabet="abcx 1\n", max_size=30),
    pats=st.lists(patterns(), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=10),
)
def test_any_split_gives_the_whole_text_result(text: str, pats: list[str], cuts: list[int]) -> None:
    """Fed in any pieces, the output is the definition's; released text never runs past it."""
    assume(all(_usable(p) for p in pats))  # compiled here, not in a strategy: regex's cache
    expected, matched = reference(text, pats)  # evicts at random, which hypothesis dislikes
    f = StopRegexFilter(pats)
    out = ""
    for chunk in split(text, cuts):
        out += f.feed(chunk)
        assert expected.startswith(out)  # nothing that is cut later was ever released
    out += f.flush()
    assert (out, f.matched) == (expected, matched)


def test_no_patterns_release_everything() -> None:
    f = StopRegexFilter([])
    assert f.feed("a b") == "a b" and f.feed(" c", check=True) == " c" and f.matched is None


# ---------------------------------------------------------------- validation
def test_patterns_given_as_a_string_or_a_list() -> None:
    assert SamplingParams(stop_regex=r"\d").stop_regex == [r"\d"]
    assert SamplingParams(stop_regex=[r"\d", "x+"]).stop_regex == [r"\d", "x+"]
    assert SamplingParams().stop_regex == []


@pytest.mark.parametrize(
    "value, words",
    [("(", "valid regular expressions"), (["ok", "[a-"], "valid regular expressions"),
     ("", "non-empty strings"), ([3], "non-empty strings"), (r"\d*", "empty text")],
)  # fmt: skip
def test_invalid_stop_regex_is_a_value_error_naming_the_field(value: object, words: str) -> None:
    with pytest.raises(ValueError, match=words) as info:
        SamplingParams(stop_regex=value)  # type: ignore[arg-type]
    assert param_of(str(info.value)) == "stop_regex"


def test_http_requests_carry_stop_regex_and_refuse_a_bad_one() -> None:
    body = CompletionRequest(prompt="hi", stop_regex=[r"\d+"])
    assert body.sampling_fields()["stop_regex"] == [r"\d+"]
    native = GenerateRequest(text="hi", sampling_params={"stop_regex": r"\n\n"})
    assert native.sampling_fields()["stop_regex"] == [r"\n\n"]
    with pytest.raises(ValueError) as info:
        CompletionRequest(prompt="hi", stop_regex="(").sampling_fields()
    assert param_of(str(info.value)) == "stop_regex"
