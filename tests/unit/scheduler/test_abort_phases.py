"""Aborting a request at any phase frees everything exactly once and disturbs no one else."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from minisgl import LLM, SamplingParams
from tests.helpers import assert_engine_clean
from tests.workloads import (
    GREEDY,
    LONG,
    OTHER,
    decoding,
    finishing_step,
    mid_chunked_prefill,
    retracted,
    step_until,
    waiting,
)


@pytest.mark.parametrize(
    "phase",
    [waiting, mid_chunked_prefill, decoding, finishing_step, retracted],
    ids=lambda f: f.__name__,
)
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_abort_frees_once(
    tiny_models: dict[str, Path], phase: Callable, overlap: bool, page_size: int
) -> None:
    llm = LLM(str(tiny_models["llama"]), chunked_prefill_size=16, page_size=page_size)
    reference = llm.generate([OTHER], GREEDY)[0]["token_ids"]
    s = llm.scheduler
    s.overlap = overlap
    if phase is finishing_step and not overlap:
        pytest.skip("only overlap scheduling has a token in flight")
    victim = s.add_request(LONG, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    other = s.add_request(OTHER, GREEDY)
    phase(s, victim)
    assert s.abort(victim.uid) is victim
    assert victim.finished and victim.finish_reason == "abort"
    assert s.abort(victim.uid) is None  # a second abort finds nothing to free
    step_until(s, lambda: other.finished and s.inflight is None, limit=400)
    s.drain()
    assert other.output_ids == reference
    assert_engine_clean(llm)
    # The engine keeps serving after the abort.
    assert llm.generate([OTHER], GREEDY)[0]["token_ids"] == reference
    assert_engine_clean(llm)


def test_overlap_switches() -> None:
    from minisgl.scheduler.scheduler import overlap_default

    assert overlap_default("cuda", False)
    assert not overlap_default("cuda", True)
    assert not overlap_default("cpu", False)
