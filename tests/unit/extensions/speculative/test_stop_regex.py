"""stop_regex with speculative decoding: several tokens land per verify step, and the request
still ends at the one that completes the match."""

from __future__ import annotations

from pathlib import Path

import pytest

from minisgl import LLM, SamplingParams
from tests.helpers import first_regex_stop

FULL = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models: dict[str, Path]) -> LLM:
    return LLM(str(tiny_models["qwen3"]))


def test_speculative_decoding_stops_inside_accepted_drafts(
    tiny_models: dict[str, Path], llm: LLM
) -> None:
    """Several tokens land per verify step; the request ends at the matching one."""
    full = llm.generate([[5, 6, 7]], FULL)[0]
    words = str(full["text"]).split(" ")
    # The second time a word pair comes round: by then the n-gram drafter proposes from the
    # first time, and drafts are accepted.
    pairs = list(zip(words, words[1:]))
    a, b = next(p for i, p in enumerate(pairs) if p in pairs[:i])
    pattern = rf"(?<!\S){a} {b}(?!\S).*(?<!\S){a} {b}(?!\S)"
    ids, text = first_regex_stop(llm, full["token_ids"], pattern)
    spec = LLM(str(tiny_models["qwen3"]), speculative_algorithm="ngram", speculative_num_steps=3)
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_regex=pattern)
    r = spec.generate([[5, 6, 7]], p)[0]
    assert (r["token_ids"], r["text"], r["matched_stop"]) == (ids, text, pattern)
    assert r["spec_accepted_tokens"] > 0
