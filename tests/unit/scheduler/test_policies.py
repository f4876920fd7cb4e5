"""The scheduler's policies themselves, not only their unchanged outputs: optimistic admission
with the new-token ratio and retraction, decodes beside a long chunked prefill, and
longest-prefix-match admission order."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from minisgl import LLM, SamplingParams
from minisgl.scheduler.request import Req, ReqState
from minisgl.scheduler.scheduler import Scheduler
from tests.helpers import assert_engine_clean


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _alone(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [llm.generate([p], params)[0]["token_ids"] for p in prompts]


def _abort_all(sched: Scheduler) -> None:
    for r in list(sched.running) + list(sched.waiting):
        sched.abort(r.uid)
    sched.drain()


# ---------------------------------------------------------------- new-token ratio, retraction
PROMPT_LEN, MAX_TOKENS = 8, 24
WORST = PROMPT_LEN + MAX_TOKENS  # a request's worst-case pages (page size 1)


def _ratio_prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, 256) for _ in range(PROMPT_LEN)] for _ in range(12)]


@pytest.fixture(scope="module")
def alone_outputs(tiny_models: dict[str, Path]) -> list[list[int]]:
    llm = LLM(str(tiny_models["llama"]), num_pages=4 * WORST)
    llm.scheduler.overlap = False
    return _alone(llm, _ratio_prompts(), _greedy(MAX_TOKENS))


@pytest.mark.parametrize("overlap", [False, True])
def test_optimistic_admission_retracts_and_resets_the_ratio(
    tiny_models: dict[str, Path], alone_outputs: list[list[int]], overlap: bool
) -> None:
    """A pool that holds four requests' worst case (prompt + max_tokens) and twelve requests:
    admission counts only the new-token ratio's share of each request's remaining tokens, so
    more than four run at once; when the pool runs dry a decode is retracted (requeued with
    its pages given back, its outputs kept), which resets the ratio to its initial value;
    otherwise the ratio falls by ``ratio_decay`` per launched batch, never below the floor.
    Every output is the request's output alone, and the pool ends clean."""
    llm = LLM(str(tiny_models["llama"]), num_pages=4 * WORST)
    sched = llm.scheduler
    sched.overlap = overlap
    init, floor = sched.config.init_new_token_ratio, sched.config.min_new_token_ratio
    decay = sched.admission.ratio_decay
    assert init > floor and decay == pytest.approx((init - floor) / 600)
    assert sched.admission.ratio == init

    # Each retraction: the victim, the decodes that wanted a page, the pages there were.
    retractions: list[tuple[Req, int, int]] = []
    retract = sched.preemption.retract

    def spy(req: Req, overcommitted: bool = True) -> None:
        assert overcommitted, "fcfs never preempts for priority"
        decodes, _ = sched.decodes.split(sched.running)
        retractions.append((req, len(decodes), sched.kv.available_pages))
        retract(req, overcommitted)
        assert sched.admission.ratio == init  # guessed too much room: conservative again
        assert req.state is ReqState.WAITING and req.row < 0 and req.kv_len == 0
        assert req is sched.waiting[0] and req not in sched.running

    sched.preemption.retract = spy  # type: ignore[method-assign]
    prompts = _ratio_prompts()
    reqs = [sched.add_request(p, _greedy(MAX_TOKENS)) for p in prompts]
    peak = 0
    while sched.has_work:
        ratio, n_retracted, n_launched = (
            sched.admission.ratio,
            sched.num_retractions,
            sched.stats["steps"],
        )
        sched.step()
        if sched.inflight is None:
            sched.check_integrity()
        peak = max(peak, len(sched.running))
        launched = sched.stats["steps"] - n_launched
        if sched.num_retractions > n_retracted:
            ratio = init  # reset by the retraction, before this step's batch was launched
        assert sched.admission.ratio == pytest.approx(max(floor, ratio - decay * launched))
        assert floor <= sched.admission.ratio <= init
    assert peak > 4, f"admission was not optimistic: at most {peak} requests ran at once"
    assert retractions, "the pool was meant to run out"
    for victim, decodes, available in retractions:
        assert available < decodes  # each decode needs one page: the pool really ran out
        assert victim.output_ids, "a decode (with outputs to keep) was retracted"
    sched.drain()
    assert all(r.finished and r.finish_reason == "length" for r in reqs)
    assert [r.output_ids for r in reqs] == alone_outputs
    assert_engine_clean(llm)

    # The floor: a decay that would cross it stops at it.
    req = sched.add_request(prompts[0], _greedy(2))
    sched.admission.ratio = floor + decay / 3
    sched.step()
    assert sched.admission.ratio == floor
    while sched.has_work:
        sched.step()
    assert req.finished
    assert_engine_clean(llm)


@pytest.mark.parametrize("overlap", [False, True])
def test_finishing_requests_are_not_retracted(tiny_models: dict[str, Path], overlap: bool) -> None:
    """With overlap scheduling, a step whose running requests all have their last token in
    flight has nothing to schedule: that is no shortage of pages, so nothing is retracted and
    the new-token ratio keeps its decay (a lone request once was retracted at its last step,
    resetting the ratio whenever the engine drained)."""
    llm = LLM(str(tiny_models["llama"]))
    sched = llm.scheduler
    sched.overlap = overlap
    init = sched.config.init_new_token_ratio
    out = llm.generate([[5, 6, 7], [8, 9]], _greedy(5))
    assert all(len(r["token_ids"]) == 5 for r in out)
    assert sched.num_retractions == 0
    launched = sched.stats["steps"]
    assert sched.admission.ratio == pytest.approx(init - sched.admission.ratio_decay * launched)
    assert_engine_clean(llm)


# ---------------------------------------------------------------- decodes beside a long prefill
LONG_PROMPT = 1500
CHUNK = 64
DECODES = 8


def _decoding_batch(llm: LLM) -> tuple[list[Req], Req]:
    """Eight requests decoding, then a long prompt queued behind them."""
    sched = llm.scheduler
    decs = [sched.add_request([3 + i, 4 + i, 5 + i, 6 + i], _greedy(80)) for i in range(DECODES)]
    while any(r.num_generated < 2 for r in decs):
        sched.step()
    assert len(sched.running) == DECODES and not sched.waiting
    rng = random.Random(2)
    long = sched.add_request([rng.randrange(3, 256) for _ in range(LONG_PROMPT)], _greedy(4))
    return decs, long


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_batches_decode_every_step_of_a_chunked_prefill(
    tiny_models: dict[str, Path], overlap: bool
) -> None:
    """Mixed batches (the default): while a 1,500-token prompt prefills in chunks, every
    running decode gains exactly one token per step; the prompt gets the rest of the step's
    budget (chunked_prefill_size less one token per decode row)."""
    llm = LLM(str(tiny_models["llama"]), chunked_prefill_size=CHUNK, context_length=2048)
    sched = llm.scheduler
    sched.overlap = overlap
    decs, long = _decoding_batch(llm)
    steps = 0
    while long.kv_len < LONG_PROMPT:
        before = [r.num_generated for r in decs]
        kv = long.kv_len
        sched.step()
        steps += 1
        assert [r.num_generated for r in decs] == [n + 1 for n in before]
        assert long.kv_len - kv == min(CHUNK - DECODES, LONG_PROMPT - kv)
    assert steps == math.ceil(LONG_PROMPT / (CHUNK - DECODES))
    assert long.num_generated == 1  # its last chunk sampled its first token
    _abort_all(sched)
    assert_engine_clean(llm)


@pytest.mark.parametrize("overlap", [False, True])
def test_without_mixed_batches_prefill_chunks_run_first(
    tiny_models: dict[str, Path], overlap: bool
) -> None:
    """disable_mixed_batch: a step is all prefill or all decode, and prefill goes first
    whenever a prompt has tokens left (`Scheduler._schedule`). So the running decodes gain
    nothing for the whole chunked prefill (ceil(1,500 / 64) = 24 steps: starved), each step
    prefilling a full chunk; once the prompt is in, all nine decode together."""
    llm = LLM(
        str(tiny_models["llama"]),
        chunked_prefill_size=CHUNK,
        context_length=2048,
        disable_mixed_batch=True,
    )
    sched = llm.scheduler
    sched.overlap = overlap
    decs, long = _decoding_batch(llm)
    stalled = [r.num_generated for r in decs]
    steps = 0
    while long.kv_len < LONG_PROMPT:
        kv = long.kv_len
        sched.step()
        steps += 1
        assert [r.num_generated for r in decs] == stalled
        assert long.kv_len - kv == min(CHUNK, LONG_PROMPT - kv)
    assert steps == math.ceil(LONG_PROMPT / CHUNK)
    sched.step()
    assert [r.num_generated for r in decs] == [n + 1 for n in stalled]
    assert long.num_generated == 2
    _abort_all(sched)
    assert_engine_clean(llm)


# ---------------------------------------------------------------- longest prefix match
P_LEN, AB_LEN, SUFFIX_LEN = 160, 120, 12


def _lpm_run(model: Path, policy: str, num_pages: int) -> dict[str, object]:
    """Cache P's prefix, then queue A, B (unrelated) and C = P + suffix with room for one
    request at a time: the order they were admitted in, the prefill tokens computed for
    them, C's cached tokens, and their outputs."""
    llm = LLM(str(model), schedule_policy=policy, max_running_requests=1, num_pages=num_pages)
    sched = llm.scheduler
    sched.overlap = False
    rng = random.Random(3)
    p = [rng.randrange(3, 256) for _ in range(P_LEN)]
    llm.generate([p], _greedy(4))
    assert sched.kv.cache.evictable_pages >= P_LEN  # P is cached
    prompts = {
        "A": [rng.randrange(3, 256) for _ in range(AB_LEN)],
        "B": [rng.randrange(3, 256) for _ in range(AB_LEN)],
        "C": p + [rng.randrange(3, 256) for _ in range(SUFFIX_LEN)],
    }
    computed = sched.prefill_tokens
    reqs = {k: sched.add_request(v, _greedy(4)) for k, v in prompts.items()}
    sched.step()
    first = [k for k, r in reqs.items() if r.state is ReqState.RUNNING]
    while sched.has_work:
        sched.step()
    assert sched.num_retractions == 0  # each was admitted once: admit_order is its turn
    assert_engine_clean(llm)
    return {
        "first": first,
        "order": sorted(reqs, key=lambda k: reqs[k].admit_order),
        "prefill": sched.prefill_tokens - computed,
        "c_cached": reqs["C"].cached_tokens,
        "outputs": [reqs[k].output_ids for k in "ABC"],
    }


@pytest.mark.parametrize("num_pages", [2048, 300], ids=["roomy", "tight"])
def test_lpm_admits_the_longest_cached_prefix_first(
    tiny_models: dict[str, Path], num_pages: int
) -> None:
    """With one request at a time, lpm admits C (P's cached prefix) before A and B, which
    keep their arrival order; fcfs admits in arrival order. lpm computes no more prefill
    tokens: as many in a roomy pool, fewer in a tight one, where A's and B's pages evict
    P's prefix before fcfs gets to C."""
    lpm = _lpm_run(tiny_models["llama"], "lpm", num_pages)
    fcfs = _lpm_run(tiny_models["llama"], "fcfs", num_pages)
    assert lpm["first"] == ["C"] and lpm["order"] == ["C", "A", "B"]
    assert fcfs["first"] == ["A"] and fcfs["order"] == ["A", "B", "C"]
    assert lpm["outputs"] == fcfs["outputs"]
    assert lpm["c_cached"] == P_LEN
    assert lpm["prefill"] == 2 * AB_LEN + SUFFIX_LEN
    if num_pages == 300:
        assert fcfs["c_cached"] == 0
        assert fcfs["prefill"] == lpm["prefill"] + P_LEN
    else:
        assert fcfs["c_cached"] == P_LEN
        assert fcfs["prefill"] == lpm["prefill"]
