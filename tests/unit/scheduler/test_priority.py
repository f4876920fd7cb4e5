"""Request priorities (--schedule-policy priority): admission in (priority, arrival) order,
retraction of the least important running request, preemption of a lower-priority running
request for a higher-priority arrival, validation, and unchanged greedy outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from minisgl import LLM, SamplingParams
from minisgl.cli import build_parser, engine_config
from minisgl.config import EngineConfig
from minisgl.scheduler.request import Req
from minisgl.scheduler.scheduler import Scheduler
from tests.helpers import assert_engine_clean

PROMPTS = [[10 + i, 20 + i, 30 + i, 40 + i] for i in range(5)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _run(sched: Scheduler, reqs: list[Req], finished: list[int] | None = None) -> list[int]:
    """Step until all are done; the uids in the order they got their first token (and, into
    ``finished``, the order they finished)."""
    order: list[int] = []
    done = finished if finished is not None else []
    while sched.has_work:
        sched.step()
        order += [r.uid for r in reqs if r.output_ids and r.uid not in order]
        done += [r.uid for r in reqs if r.finished and r.uid not in done]
    sched.drain()
    return order


def _alone(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [llm.generate([p], q)[0]["token_ids"] for p, q in zip(prompts, params)]


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_admission_order(tiny_models: dict[str, Path], policy: str) -> None:
    """One request at a time: with the policy they start in (priority, arrival) order, with
    fcfs in arrival order; every output equals the request's output run alone."""
    llm = LLM(str(tiny_models["llama"]), schedule_policy=policy, max_running_requests=1)
    sched = llm.scheduler
    sched.overlap = False
    priorities = [3, 1, 3, -2, 1] if policy == "priority" else [0] * 5
    reqs = [sched.add_request(p, _greedy(4), priority=q) for p, q in zip(PROMPTS, priorities)]
    order = _run(sched, reqs)
    if policy == "priority":
        assert order == [reqs[i].uid for i in (3, 1, 4, 0, 2)]  # ties (1, 4), (0, 2) by arrival
    else:
        assert order == [r.uid for r in reqs]
    assert [r.output_ids for r in reqs] == _alone(llm, PROMPTS, [_greedy(4)] * 5)
    assert sched.num_retractions == 0
    assert_engine_clean(llm)


@pytest.mark.parametrize("overlap", [False, True])
def test_higher_priority_arrival_preempts(tiny_models: dict[str, Path], overlap: bool) -> None:
    """With every request slot taken by low-priority decodes, a higher-priority arrival
    retracts the least important of them (largest value, then the latest arrival), runs
    first, and finishes before it; equal or lower priorities never preempt."""
    llm = LLM(str(tiny_models["llama"]), schedule_policy="priority", max_running_requests=2)
    sched = llm.scheduler
    sched.overlap = overlap
    low = [
        sched.add_request(PROMPTS[0], _greedy(30), priority=5),
        sched.add_request(PROMPTS[1], _greedy(30), priority=5),
    ]
    while not all(len(r.output_ids) >= 3 for r in low):
        sched.step()
    same = sched.add_request(PROMPTS[2], _greedy(4), priority=5)
    for _ in range(3):
        sched.step()
    assert sched.num_priority_preemptions == 0 and same in sched.waiting  # no preemption
    high = sched.add_request(PROMPTS[3], _greedy(4), priority=0)
    finished: list[int] = []
    order = _run(sched, [*low, same, high], finished)
    assert sched.num_priority_preemptions == 1
    assert order.index(high.uid) < order.index(same.uid)
    # The victim, the later arrival of the two equal low priorities, waited for the new one.
    assert finished.index(high.uid) < finished.index(low[1].uid)
    assert finished[0] == high.uid
    params = [_greedy(30), _greedy(30), _greedy(4), _greedy(4)]
    expected = _alone(llm, [PROMPTS[i] for i in range(4)], params)
    assert [r.output_ids for r in (*low, same, high)] == expected
    assert_engine_clean(llm)


def test_preemption_victim_is_the_later_arrival(tiny_models: dict[str, Path]) -> None:
    llm = LLM(str(tiny_models["llama"]), schedule_policy="priority", max_running_requests=2)
    sched = llm.scheduler
    sched.overlap = False
    victims: list[Req] = []
    retract = sched.preemption.retract

    def spy(req: Req, overcommitted: bool = True) -> None:
        victims.append(req)
        retract(req, overcommitted)

    sched.preemption.retract = spy  # type: ignore[method-assign]
    a = sched.add_request(PROMPTS[0], _greedy(20), priority=4)
    b = sched.add_request(PROMPTS[1], _greedy(20), priority=7)  # least important
    while not all(r.output_ids for r in (a, b)):
        sched.step()
    high = sched.add_request(PROMPTS[2], _greedy(3), priority=-1)
    _run(sched, [a, b, high])
    assert victims == [b]
    assert_engine_clean(llm)


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_retraction_under_memory_pressure(tiny_models: dict[str, Path], policy: str) -> None:
    """A pool too small for every running request's growth: each retraction takes the least
    important running request (largest priority, then latest arrival) with the policy, the
    latest admitted with fcfs; outputs stay those of each request alone."""
    llm = LLM(
        str(tiny_models["llama"]),
        schedule_policy=policy,
        num_pages=120,
        init_new_token_ratio=0.05,
        min_new_token_ratio=0.05,
    )
    sched = llm.scheduler
    sched.overlap = False
    seen: list[tuple[Req, list[Req]]] = []
    retract = sched.preemption.retract

    def spy(req: Req, overcommitted: bool = True) -> None:
        seen.append((req, list(sched.running)))
        retract(req, overcommitted)

    sched.preemption.retract = spy  # type: ignore[method-assign]
    prompts = [list(range(10 * i + 3, 10 * i + 13)) for i in range(5)]
    priorities = [2, 0, 3, 1, 0] if policy == "priority" else [0] * 5
    reqs = [sched.add_request(p, _greedy(50), priority=q) for p, q in zip(prompts, priorities)]
    _run(sched, reqs)
    assert seen, "the small pool was meant to force retraction"
    for victim, running in seen:
        if policy == "priority":
            assert victim is max(running, key=lambda r: (r.priority, r.arrival))
        else:
            assert victim is max(running, key=lambda r: r.admit_order)
    assert sched.num_priority_preemptions == 0  # all arrived together: no admission preemption
    assert [r.output_ids for r in reqs] == _alone(llm, prompts, [_greedy(50)] * 5)
    assert_engine_clean(llm)


def test_generate_priority_argument(tiny_models: dict[str, Path]) -> None:
    llm = LLM(str(tiny_models["llama"]), schedule_policy="priority", max_running_requests=1)
    out = llm.generate(PROMPTS[:3], _greedy(3), priority=[2, -1, 0])
    assert [r["token_ids"] for r in out] == _alone(llm, PROMPTS[:3], [_greedy(3)] * 3)
    assert_engine_clean(llm)


@pytest.mark.parametrize(
    ("priority", "match"),
    [
        ([True, 0], "priority must be an integer"),
        ([1.5, 0], "priority must be an integer"),
        (["1", 0], "priority must be an integer"),
        ([2**63, 0], "priority must be in"),
        ([0], "priority must have one entry per prompt"),
        (3, "priority must be a list"),
    ],
)
def test_generate_rejects_bad_priority(
    tiny_models: dict[str, Path], priority: Any, match: str
) -> None:
    llm = LLM(str(tiny_models["llama"]), schedule_policy="priority")
    with pytest.raises(ValueError, match=match):
        llm.generate(PROMPTS[:2], _greedy(2), priority=priority)
    assert not llm.scheduler.waiting and not llm.scheduler.running  # nothing queued
    assert_engine_clean(llm)


def test_nonzero_priority_needs_the_policy(tiny_models: dict[str, Path]) -> None:
    """vLLM's rule: without the priority policy, 0 is accepted and anything else refused."""
    llm = LLM(str(tiny_models["llama"]))
    with pytest.raises(ValueError, match="priority must be 0 unless priority scheduling"):
        llm.generate(PROMPTS[:2], _greedy(2), priority=[0, 1])
    assert not llm.scheduler.waiting
    out = llm.generate(PROMPTS[:2], _greedy(2), priority=[0, 0])
    assert all(len(r["token_ids"]) == 2 for r in out)
    with pytest.raises(ValueError, match="priority"):
        llm.scheduler.add_request(PROMPTS[0], _greedy(2), priority=-1)
    assert_engine_clean(llm)


def test_config_and_flags() -> None:
    assert EngineConfig(schedule_policy="priority").schedule_policy == "priority"
    with pytest.raises(ValueError, match="fcfs, lpm or priority"):
        EngineConfig(schedule_policy="sjf")
    for flag in ("--schedule-policy", "--scheduling-policy"):
        args = build_parser().parse_args([flag, "priority"])
        assert engine_config(args).schedule_policy == "priority"
