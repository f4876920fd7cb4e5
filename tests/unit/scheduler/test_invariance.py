"""Every scheduling optimisation can be switched off without changing greedy outputs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams
from tests.helpers import assert_engine_clean
from tests.workloads import SCHEDULING_BASE, scheduling_workload

VARIANTS = {
    "naive": dict(cache="naive"),
    "chunk16": dict(chunked_prefill_size=16),
    "page16": dict(page_size=16, num_pages=256),
    "page16-chunk16-lpm": dict(
        page_size=16, num_pages=256, chunked_prefill_size=16, schedule_policy="lpm"
    ),
    "no-mixed": dict(disable_mixed_batch=True, chunked_prefill_size=64),
    "small-pool": dict(num_pages=260, max_running_requests=6, init_new_token_ratio=0.05),
    "small-pool-page4": dict(
        num_pages=70, page_size=4, chunked_prefill_size=32, init_new_token_ratio=0.05
    ),
    "lpm": dict(schedule_policy="lpm"),
    "naive-small-pool-nomixed": dict(
        cache="naive", num_pages=200, disable_mixed_batch=True, init_new_token_ratio=0.05
    ),
    # Overlap scheduling (results processed one step late) forced on, also on CPU.
    "overlap": dict(overlap=True),
    "overlap-small-pool-chunk16": dict(
        overlap=True,
        num_pages=260,
        max_running_requests=6,
        init_new_token_ratio=0.05,
        chunked_prefill_size=16,
    ),
    "overlap-page16-nomixed": dict(
        overlap=True, page_size=16, num_pages=256, disable_mixed_batch=True
    ),
    # Priorities (PRIORITIES below) reorder admission and retraction, never the tokens.
    "priority": dict(schedule_policy="priority"),
    "priority-small-pool": dict(
        schedule_policy="priority", num_pages=260, max_running_requests=6, init_new_token_ratio=0.05
    ),
    "overlap-priority-small-pool-chunk16": dict(
        schedule_policy="priority",
        overlap=True,
        num_pages=260,
        max_running_requests=6,
        init_new_token_ratio=0.05,
        chunked_prefill_size=16,
    ),
}
# Mixed, with ties, so that the queue order differs from arrival order.
PRIORITIES = [(i * 7) % 5 - 2 for i in range(15)]


@pytest.fixture(scope="module")
def reference(tiny_models: dict[str, Path]) -> list[list[int]]:
    prompts, params = scheduling_workload()
    llm = LLM(str(tiny_models["llama"]), **SCHEDULING_BASE)
    return [r["token_ids"] for r in llm.generate(prompts, params)]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_outputs_identical(
    tiny_models: dict[str, Path], reference: list[list[int]], name: str
) -> None:
    prompts, params = scheduling_workload()
    options = {**SCHEDULING_BASE, **VARIANTS[name]}
    overlap = bool(options.pop("overlap", False))
    llm = LLM(str(tiny_models["llama"]), **options)
    llm.scheduler.overlap = overlap
    priority = PRIORITIES if options["schedule_policy"] == "priority" else None
    out = llm.generate(prompts, params, priority=priority)
    assert [r["token_ids"] for r in out] == reference
    assert_engine_clean(llm)
    if "small-pool" in name:
        assert llm.scheduler.num_retractions > 0, "the small pool was meant to force preemption"


def test_shared_prefix_saves_prefill(tiny_models: dict[str, Path]) -> None:
    rng = random.Random(0)
    system = [rng.randrange(3, 256) for _ in range(512)]
    prompts = [system + [rng.randrange(3, 256) for _ in range(8)] for _ in range(32)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    computed = {}
    outputs = {}
    for cache in ("radix", "naive"):
        llm = LLM(str(tiny_models["qwen3"]), cache=cache, context_length=1024, num_pages=20000)
        outputs[cache] = [r["token_ids"] for r in llm.generate(prompts, params)]
        computed[cache] = llm.scheduler.prefill_tokens
        assert_engine_clean(llm)
    assert outputs["radix"] == outputs["naive"]
    assert computed["radix"] <= 0.15 * computed["naive"], computed


def test_cached_tokens_reported(tiny_models: dict[str, Path]) -> None:
    llm = LLM(str(tiny_models["qwen3"]), page_size=4)
    p = list(range(10, 60))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = llm.generate([p], params)[0]
    second = llm.generate([p + [7, 8]], params)[0]
    assert first["cached_tokens"] == 0
    assert second["cached_tokens"] == 48  # 50 prompt tokens, page-aligned down
    assert llm.scheduler.kv.cache.stats.hit_rate > 0


def test_prefill_keeps_a_share_of_the_budget_beside_many_decodes(
    tiny_models: dict[str, Path],
) -> None:
    """With as many decoding rows as the step's token budget, a new prompt still gets a
    chunk in the next step (a quarter of the budget) instead of waiting for a decode to
    finish."""
    llm = LLM(str(tiny_models["llama"]), chunked_prefill_size=16, max_running_requests=32)
    sched = llm.scheduler
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i in range(20):
        sched.add_request([5 + i, 6, 7], long)
    while sched.waiting or any(r.num_generated < 2 for r in sched.running):
        sched.step()
    assert len(sched.running) == 20
    late = sched.add_request(list(range(10, 50)), long)
    sched.step()
    sched.step()  # with overlap the first step may only launch
    assert late.kv_len >= 4, late.kv_len  # 16 // 4 tokens per step at least
    for r in list(sched.running) + list(sched.waiting):
        sched.abort(r.uid)
    sched.drain()
    assert_engine_clean(llm)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("context_length", [37, 38])
def test_context_end_is_the_same_with_overlap(
    tiny_models: dict[str, Path], page_size: int, context_length: int
) -> None:
    """A request that runs into the context length ends with prompt + output = context, with
    overlap scheduling as without (upstream #68's area). Overlap once ended it a token early:
    the stop check counted the token still in flight as if its value were known."""
    prompts = [list(range(3, 13)), list(range(40, 47))]
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    outs = []
    for overlap in (False, True):
        llm = LLM(
            str(tiny_models["llama"]),
            page_size=page_size,
            num_pages=64,
            context_length=context_length,
        )
        llm.scheduler.overlap = overlap
        got = llm.generate(prompts, params)
        for p, r in zip(prompts, got):
            assert len(r["token_ids"]) == context_length - len(p), (overlap, len(r["token_ids"]))
            assert r["finish_reason"] == "length"
        outs.append([r["token_ids"] for r in got])
        assert_engine_clean(llm)
    assert outs[0] == outs[1]


@pytest.mark.parametrize(
    "options",
    [dict(chunked_prefill_size=16), dict(page_size=16, num_pages=256, chunked_prefill_size=16)],
    ids=["page1-chunk16", "page16-chunk16"],
)
def test_rows_point_at_their_cached_prefix_at_every_step(
    tiny_models: dict[str, Path], options: dict
) -> None:
    """The integrity check between every step of a prefix-sharing workload (requests that
    repeat a prompt, chunked so several compute the same prefix): each live row's cached
    prefix is its locked tree path (upstream #142). A row pointing elsewhere is caught."""
    prompts, params = scheduling_workload()
    llm = LLM(str(tiny_models["llama"]), **{**SCHEDULING_BASE, **options})
    sched = llm.scheduler
    sched.overlap = False  # the check is defined between batches
    for ids, p in zip(prompts, params):
        sched.add_request(ids, p)
    checked = 0
    while sched.has_work:
        sched.step()
        sched.check_integrity()
        checked += sum(r.tree_len > 0 for r in sched.running)
    assert checked > 0, "no step had a live request with a cached prefix"
    assert_engine_clean(llm)
    # The check itself: a live request whose row stops pointing at its prefix's pages.
    sched.add_request(prompts[1], params[1])
    while not any(r.tree_len > 0 for r in sched.running):
        sched.step()
    req = next(r for r in sched.running if r.tree_len > 0)
    table = sched.kv.host_table
    table[req.row, 0] = table[req.row, 0] + 1
    with pytest.raises(AssertionError, match="does not point at its cached prefix"):
        sched.check_integrity()


@pytest.mark.parametrize("name", ["page16-chunk16-lpm", "small-pool", "overlap-small-pool-chunk16"])
def test_device_table_mirror_rides_in_the_step(
    tiny_models: dict[str, Path], reference: list[list[int]], name: str
) -> None:
    """On a GPU the scheduler writes a host copy of the page table and each step carries
    the new entries to the device table in its one staged copy (StepInput.table). On the
    CPU both are one tensor; here they are split, so attention reads only what the steps
    carried: the same greedy tokens, and after the last step the two tables agree."""
    prompts, params = scheduling_workload()
    options = {**SCHEDULING_BASE, **VARIANTS[name]}
    overlap = bool(options.pop("overlap", False))
    llm = LLM(str(tiny_models["llama"]), **options)
    kv = llm.scheduler.kv
    assert kv.device_table is llm.engine.page_table
    kv.host_table = kv.device_table.clone()  # the GPU layout: a host mirror of its own
    llm.scheduler.overlap = overlap
    out = llm.generate(prompts, params)
    assert [r["token_ids"] for r in out] == reference
    kv.flush()
    assert torch.equal(kv.device_table, kv.host_table)
    assert_engine_clean(llm)
