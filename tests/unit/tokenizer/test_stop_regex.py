"""stop_regex: the matcher and its streaming hold-back (no model), the parameter's validation,
and the offline API end to end on a tiny model with a word-level tokenizer."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import regex
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from minisgl import LLM, SamplingParams
from minisgl.scheduler.scheduler import Scheduler
from minisgl.scheduler.stop import TokenizerDecoder
from minisgl.server.errors import param_of
from minisgl.server.native_protocol import GenerateRequest
from minisgl.server.protocol import CompletionRequest
from minisgl.tokenizer.stop_regex import StopRegexFilter
from tests.helpers import assert_engine_clean, first_regex_stop


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


def test_an_end_of_word_match_from_before_the_end_is_held_back() -> None:
    # Found by the property test below: regex's partial search of ".*?\M" in " " reports a
    # partial match at 1, yet " 1" matches from 0: the space must be held back.
    f = StopRegexFilter([r"a|.*?\M"])
    assert f.feed(" ") == ""
    assert f.feed("1") == ""
    assert f.matched == r"a|.*?\M" and f.cut == 0


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
    assert body.to_sampling_params().stop_regex == [r"\d+"]
    native = GenerateRequest(text="hi", sampling_params={"stop_regex": r"\n\n"})
    assert native.to_sampling_params().stop_regex == [r"\n\n"]
    with pytest.raises(ValueError) as info:
        CompletionRequest(prompt="hi", stop_regex="(").to_sampling_params()
    assert param_of(str(info.value)) == "stop_regex"


# ---------------------------------------------------------------- offline, end to end
FULL = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models: dict[str, Path]) -> LLM:
    return LLM(str(tiny_models["qwen3"]))


def _later_word_pattern(full: dict[str, object]) -> str:
    words = str(full["text"]).split(" ")
    # Two words after the first few, as whole words: the match spans two tokens.
    return rf"(?<!\S){words[6]} {words[7]}(?!\S)"


def test_generation_stops_at_the_match_and_cuts_the_text(llm: LLM) -> None:
    full = llm.generate([[5, 6, 7]], FULL)[0]
    pattern = _later_word_pattern(full)
    ids, text = first_regex_stop(llm, full["token_ids"], pattern)
    assert len(ids) < len(full["token_ids"])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_regex=pattern)
    r = llm.generate([[5, 6, 7]], params)[0]
    assert r["token_ids"] == ids  # not one token past the match
    assert r["text"] == text and str(full["text"]).startswith(text)
    assert r["finish_reason"] == "stop" and r["matched_stop"] == pattern
    assert_engine_clean(llm)


def test_the_first_completed_pattern_wins_and_strings_still_work(llm: LLM) -> None:
    full = llm.generate([[5, 6, 7]], FULL)[0]
    words = str(full["text"]).split(" ")
    late, early = _later_word_pattern(full), rf"(?<!\S){words[3]}(?!\S)"
    ids, text = first_regex_stop(llm, full["token_ids"], early)
    params = SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, stop_regex=["zzz", late, early]
    )
    r = llm.generate([[5, 6, 7]], params)[0]
    assert (r["token_ids"], r["text"], r["matched_stop"]) == (ids, text, early)
    # A stop string that completes first still wins, and is reported as itself.
    params = SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, stop=words[2], stop_regex=late
    )
    r = llm.generate([[5, 6, 7]], params)[0]
    text = str(full["text"])
    assert r["matched_stop"] == words[2] and r["text"] == text[: text.find(words[2])]


def test_min_tokens_defers_the_regex(llm: LLM) -> None:
    full = llm.generate([[5, 6, 7]], FULL)[0]["token_ids"]
    p = SamplingParams(temperature=0, max_tokens=24, min_tokens=3, stop_regex=r"t\d+")
    r = llm.generate([[5, 6, 7]], p)[0]
    # Every word matches; the first two tokens are not examined, the third one stops.
    assert r["token_ids"] == full[:3]
    assert r["text"] == llm.tokenizer.decode(full[:2]) + " "


def test_n_choices_each_stop(llm: LLM) -> None:
    full = llm.generate([[5, 6, 7]], FULL)[0]
    pattern = _later_word_pattern(full)
    ids, text = first_regex_stop(llm, full["token_ids"], pattern)
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_regex=pattern, n=3)
    out = llm.generate([[5, 6, 7], [5, 6, 7]], p)
    assert len(out) == 6
    assert all(r["token_ids"] == ids and r["text"] == text for r in out)


def test_overlap_scheduling_ends_exactly_at_the_match(tiny_models: dict[str, Path]) -> None:
    """With overlap the next step is launched before this one's token is read: the request
    must still end at the matching token, its in-flight token dropped."""
    llm = LLM(str(tiny_models["qwen3"]))
    full = llm.generate([[5, 6, 7]], FULL)[0]
    llm.scheduler = Scheduler(llm.engine, decode=TokenizerDecoder(llm.tokenizer), overlap=True)
    pattern = _later_word_pattern(full)
    ids, text = first_regex_stop(llm, full["token_ids"], pattern)
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_regex=pattern)
    out = llm.generate([[5, 6, 7], [9, 10]], [p, FULL])
    assert out[0]["token_ids"] == ids and out[0]["text"] == text
    assert out[1]["finish_reason"] == "length"
    assert_engine_clean(llm)


def test_bad_regex_queues_nothing(llm: LLM) -> None:
    p = SamplingParams(temperature=0, max_tokens=4)
    # Frozen: an edit is a new object, validated like the first (before anything is queued).
    with pytest.raises(ValueError, match="stop_regex"):
        llm.generate([[5, 6, 7], [8, 9]], [FULL, replace(p, stop_regex=["ok", "(unclosed"])])
    assert not llm.scheduler.waiting and not llm.scheduler.running
    assert_engine_clean(llm)
