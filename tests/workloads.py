"""Requests the tests send and the drivers that step a scheduler through them: shared-prefix
and mixed workloads, the abort-mix driver, the phases a request can be aborted in, and the
worked chat turns that make the default model think before it answers."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from minisgl.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minisgl.scheduler.request import Req
    from minisgl.scheduler.scheduler import Scheduler


def shared_prefix_workload(
    seed: int, requests: int, system_len: int, max_tail: int, max_tokens: int
) -> tuple[list[list[int]], list[Any]]:
    """Greedy requests, every other one behind one shared system prompt (radix-cache hits),
    with random tails of 1..max_tail ids and 4..max_tokens output tokens (ignore_eos)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 256) for _ in range(system_len)]
    prompts = []
    for i in range(requests):
        tail = [rng.randrange(3, 256) for _ in range(rng.randint(1, max_tail))]
        prompts.append(system + tail if i % 2 else tail)
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(4, max_tokens), ignore_eos=True)
        for _ in prompts
    ]
    return prompts, params


def abort_mix_workload(
    seed: int = 0, long_tokens: tuple[int, int] = (16, 32)
) -> list[tuple[list[int], Any, int]]:
    """(prompt, params, wave) for 18 greedy requests: long decodes of ``long_tokens`` (a
    range; half of them behind a shared prefix) alternating with one short prompt repeated, max_tokens 1 or 2 (finished in
    their first steps); wave w joins after step (0, 2, 5)[w]."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 256) for _ in range(40)]
    short = [17, 18, 19, 20, 21, 22]
    out = []
    for i in range(18):
        if i % 2 == 0:
            tail = [rng.randrange(3, 256) for _ in range(rng.randint(5, 120))]
            prompt, n = (shared if i % 4 == 0 else []) + tail, rng.randint(*long_tokens)
        else:
            prompt, n = short, 1 + (i // 2) % 2
        out.append((prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), i // 6))
    return out


# Each victim (every third request) is aborted once it is unfinished and this holds; "last"
# (num_generated reaches max_tokens) is only reachable under overlap scheduling, with the
# last token in flight: the finishing step (SGLang PR #111: freed twice).
ABORT_AT: dict[int, int | str] = {2: 0, 5: "last", 8: 3, 11: 1, 14: "last", 17: "last"}


def run_abort_mix(
    llm: Any,
    before_abort: Callable[[Any], None] | None = None,
    long_tokens: tuple[int, int] = (16, 32),
) -> tuple[list[Any], set[int]]:
    """Drive ``llm``'s scheduler through ``abort_mix_workload`` step by step, aborting the
    victims of ``ABORT_AT`` between steps, until idle. Returns the requests and the indices
    that were aborted (``before_abort`` sees each victim just before)."""
    sched = llm.scheduler
    work = abort_mix_workload(long_tokens=long_tokens)
    joins = {0: 0, 1: 2, 2: 5}
    reqs: list[Any] = [None] * len(work)
    aborted: set[int] = set()
    for step in range(1000):
        for i, (prompt, params, wave) in enumerate(work):
            if joins[wave] == step:
                reqs[i] = sched.add_request(prompt, params)
        for i, at in ABORT_AT.items():
            req = reqs[i]
            if req is None or req.finished or i in aborted:
                continue
            limit = req.params.max_tokens if at == "last" else at
            if req.num_generated >= limit:
                if before_abort is not None:
                    before_abort(req)
                assert sched.abort(req.uid) is req
                assert req.finished and req.finish_reason == "abort"
                assert sched.abort(req.uid) is None  # freed once: a second abort finds nothing
                aborted.add(i)
        if step > max(joins.values()) and not sched.has_work:
            break
        sched.step()
    else:
        raise AssertionError("the scheduler never went idle")
    sched.drain()
    return reqs, aborted


def check_abort_mix(reqs: list[Any], aborted: set[int], ref: list[Any], overlap: bool) -> None:
    """Survivors' tokens equal the reference run's; an aborted request kept a prefix of them.
    Under overlap every victim was aborted, a finishing-step victim with its in-flight last
    sample dropped; without it the finishing-step victims completed."""
    last = {i for i, at in ABORT_AT.items() if at == "last"}
    assert aborted == (set(ABORT_AT) if overlap else set(ABORT_AT) - last)
    for i, (req, want) in enumerate(zip(reqs, ref)):
        if i in aborted:
            assert req.finish_reason == "abort", i
            assert req.output_ids == want.output_ids[: len(req.output_ids)], i
            if i in last:
                assert len(req.output_ids) == req.params.max_tokens - 1, i
        else:
            assert req.finish_reason == "length", (i, req.finish_reason)
            assert req.output_ids == want.output_ids, i


# Three worked turns that teach the default model (SmolLM2) to think in <think>...</think>
# before its JSON: a greedy reply to ``thinking_chat(city)`` then thinks, and ends its
# thinking, on its own (structured output that waits for the thinking, grammar_after).
THINKING_SHOTS = [("Rome", "Rome is big"), ("Oslo", "Oslo is cold"), ("Lima", "Lima is warm")]


def thinking_chat(city: str = "Paris") -> list[dict[str, str]]:
    """The worked turns, then the question about ``city``."""
    turns = [
        turn
        for shot, thought in THINKING_SHOTS
        for turn in (
            {"role": "user", "content": f"Describe {shot} as JSON."},
            {"role": "assistant", "content": f'<think>{thought}</think>\n\n{{"city": "{shot}"}}'},
        )
    ]
    return turns + [{"role": "user", "content": f"Describe {city} as JSON."}]


def scheduling_workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """15 greedy requests, most behind one 70-token system prompt, one an exact repeat: what
    every scheduling option (and speculation) must answer with the same tokens."""
    rng = random.Random(7)
    system = [rng.randrange(3, 256) for _ in range(70)]
    prompts: list[list[int]] = []
    for i in range(14):
        if i % 3 == 0:
            body = [rng.randrange(3, 256) for _ in range(rng.randint(1, 120))]
        else:
            body = system + [rng.randrange(3, 256) for _ in range(rng.randint(1, 30))]
        prompts.append(body)
    prompts.append(list(prompts[1]))  # an exact repeat
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(5, 40), ignore_eos=True)
        for _ in prompts
    ]
    return prompts, params


# The engine options scheduling_workload's reference run uses; variants override some.
SCHEDULING_BASE: dict[str, Any] = dict(
    page_size=1, cache="radix", chunked_prefill_size=8192, schedule_policy="fcfs", num_pages=4096
)


# ---------------------------------------------------------------- abort phases
# A long victim aborted in some phase beside a short request that must not notice.
LONG = list(range(3, 103))
OTHER = [7, 8, 9, 10, 11]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def step_until(sched: Scheduler, cond: Callable[[], bool], limit: int = 200) -> None:
    """Step the scheduler until ``cond`` holds (at most ``limit`` steps)."""
    for _ in range(limit):
        if cond():
            return
        sched.step()
    raise AssertionError("condition never reached")


def waiting(s: Scheduler, victim: Req) -> None:
    pass  # never stepped: still in the queue


def mid_chunked_prefill(s: Scheduler, victim: Req) -> None:
    step_until(s, lambda: 0 < victim.kv_len < len(victim.prompt_ids))


def decoding(s: Scheduler, victim: Req) -> None:
    step_until(s, lambda: len(victim.output_ids) >= 2)


def finishing_step(s: Scheduler, victim: Req) -> None:
    # Its last token is sampled by the batch in flight: abort before the host sees it.
    step_until(s, lambda: victim.num_generated >= victim.params.max_tokens and victim.inflight > 0)


def retracted(s: Scheduler, victim: Req) -> None:
    step_until(s, lambda: len(victim.output_ids) >= 1)
    s.preemption.retract(victim)  # as when the pool runs dry during decode
    assert victim in s.waiting and victim.output_ids


ABORT_PHASES: dict[str, Callable[[Scheduler, Req], None]] = {
    f.__name__: f for f in (waiting, mid_chunked_prefill, decoding, finishing_step, retracted)
}
