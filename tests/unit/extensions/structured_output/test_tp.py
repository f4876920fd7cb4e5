"""Structured output under tensor parallelism (2 CPU ranks over gloo): every rank keeps its
own grammar matchers and the constrained tokens equal TP=1's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from minisgl import LLM, SamplingParams
from tests.helpers import assert_engine_clean

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("short_dist_timeout")]
OPTIONS: dict[str, Any] = {"chunked_prefill_size": 16, "num_pages": 512, "cache": "radix"}


def test_tp2_structured_output_matches_tp1(tiny_models: dict[str, Path]) -> None:
    """Every rank keeps its own grammar matchers, fed the same tokens: constrained requests
    (mixed with a free one) give TP=1's tokens. The tiny tokenizer's words are t3, t4, ...:
    the regex allows one of t10..t19, then one of t20..t29, then only EOS (</s>, id 2)."""
    pytest.importorskip("xgrammar")
    path = str(tiny_models["llama"])
    params = [
        SamplingParams(temperature=0, max_tokens=8, regex="t1[0-9]t2[0-9]"),
        SamplingParams(temperature=0.9, seed=3, max_tokens=8, regex="t1[0-9]t2[0-9]"),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    ]
    prompts = [[5, 6, 7], [8, 9], [10, 11]]
    ref = LLM(path, **OPTIONS).generate(prompts, params)
    for out in ref[:2]:
        ids = out["token_ids"]
        assert 10 <= ids[0] <= 19 and 20 <= ids[1] <= 29 and ids[2:] == [2], ids
        assert out["finish_reason"] == "stop"
    with LLM(path, tp_size=2, **OPTIONS) as llm:
        assert llm.generate(prompts, params) == ref
        assert_engine_clean(llm)
