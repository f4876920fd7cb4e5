"""Aborting a request at any phase frees everything exactly once and disturbs no one else."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from minisgl import LLM, SamplingParams
from minisgl.scheduler.request import Req
from minisgl.scheduler.scheduler import Scheduler
from tests.conftest import assert_engine_clean

LONG = list(range(3, 103))
OTHER = [7, 8, 9, 10, 11]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _until(sched: Scheduler, cond: Callable[[], bool], limit: int = 200) -> None:
    for _ in range(limit):
        if cond():
            return
        sched.step()
    raise AssertionError("condition never reached")


def _waiting(s: Scheduler, victim: Req) -> None:
    pass  # never stepped: still in the queue


def _mid_chunked_prefill(s: Scheduler, victim: Req) -> None:
    _until(s, lambda: 0 < victim.kv_len < len(victim.prompt_ids))


def _decoding(s: Scheduler, victim: Req) -> None:
    _until(s, lambda: len(victim.output_ids) >= 2)


def _finishing_step(s: Scheduler, victim: Req) -> None:
    # Its last token is sampled by the batch in flight: abort before the host sees it.
    _until(s, lambda: victim.num_generated >= victim.params.max_tokens and victim.inflight > 0)


def _retracted(s: Scheduler, victim: Req) -> None:
    _until(s, lambda: len(victim.output_ids) >= 1)
    s.preemption.retract(victim)  # as when the pool runs dry during decode
    assert victim in s.waiting and victim.output_ids


@pytest.mark.parametrize(
    "phase",
    [_waiting, _mid_chunked_prefill, _decoding, _finishing_step, _retracted],
    ids=lambda f: f.__name__.strip("_"),
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
    if phase is _finishing_step and not overlap:
        pytest.skip("only overlap scheduling has a token in flight")
    victim = s.add_request(LONG, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    other = s.add_request(OTHER, GREEDY)
    phase(s, victim)
    assert s.abort(victim.uid) is victim
    assert victim.finished and victim.finish_reason == "abort"
    assert s.abort(victim.uid) is None  # a second abort finds nothing to free
    _until(s, lambda: other.finished and s.inflight is None, limit=400)
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
