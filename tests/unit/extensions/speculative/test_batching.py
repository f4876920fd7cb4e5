"""Speculative decoding inside continuous batching: greedy outputs equal the plain engine's
with a draft model (the target itself, a near copy, another architecture) and with n-grams,
across batching, the radix cache, chunked prefill, page sizes and forced retraction; the
speculation figures are reported per request and in the server metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

from minisgl import LLM, SamplingParams
from minisgl.scheduler.scheduler import Scheduler
from tests.helpers import TinyModels, assert_engine_clean
from tests.workloads import (
    ABORT_PHASES,
    GREEDY,
    LONG,
    OTHER,
    SCHEDULING_BASE,
    scheduling_workload,
    step_until,
)

K = 3
SMALL_POOL_PAGE4 = dict(
    page_size=4, num_pages=70, chunked_prefill_size=32, init_new_token_ratio=0.05
)
CASES: dict[str, dict[str, object]] = {
    "same": dict(draft="same"),
    "same-page4-chunk-retract": dict(draft="same", **SMALL_POOL_PAGE4),
    "near-small-pool": dict(
        draft="near", num_pages=260, max_running_requests=6, init_new_token_ratio=0.05
    ),
    "near-page4-chunk16-lpm-overlap": dict(
        draft="near", page_size=4, chunked_prefill_size=16, schedule_policy="lpm", overlap=True
    ),
    "qwen3-naive": dict(draft="qwen3", cache="naive"),
    "ngram-page4-chunk-retract": dict(draft="ngram", **SMALL_POOL_PAGE4),
}


@pytest.fixture(scope="module")
def drafts(tiny_models: TinyModels) -> dict[str, Path]:
    target = tiny_models["llama"]
    near = tiny_models.perturbed(target, scale=0.004)
    return {"same": target, "near": near, "qwen3": tiny_models["qwen3"]}


@pytest.fixture(scope="module")
def reference(tiny_models: dict[str, Path]) -> list[list[int]]:
    prompts, params = scheduling_workload()
    llm = LLM(str(tiny_models["llama"]), **SCHEDULING_BASE)
    return [r["token_ids"] for r in llm.generate(prompts, params)]


def _spec_llm(target: Path, draft: str, drafts: dict, **options: object) -> LLM:  # type: ignore[type-arg]
    if draft == "ngram":
        return LLM(str(target), speculative_algorithm="ngram", speculative_num_steps=K, **options)
    return LLM(
        str(target), speculative_draft_model=str(drafts[draft]), speculative_num_steps=K, **options
    )


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_outputs_unchanged(
    tiny_models: dict[str, Path],
    drafts: dict,  # type: ignore[type-arg]
    reference: list[list[int]],
    name: str,
) -> None:
    options = {**SCHEDULING_BASE, **CASES[name]}
    draft, overlap = str(options.pop("draft")), bool(options.pop("overlap", False))
    llm = _spec_llm(tiny_models["llama"], draft, drafts, **options)
    if overlap:  # asked for, but speculation needs each step's tokens before the next
        llm.scheduler = Scheduler(
            llm.engine, decode=llm.scheduler.stop_checker.decode, overlap=True
        )
        assert not llm.scheduler.overlap
    prompts, params = scheduling_workload()
    out = llm.generate(prompts, params)
    assert [r["token_ids"] for r in out] == reference
    assert_engine_clean(llm)
    totals = llm.scheduler.totals
    assert totals["spec_verify_steps"] > 0
    if draft == "same":  # the draft is the target: every draft is kept
        assert totals["spec_accepted_tokens"] == totals["spec_draft_tokens"] > 0
    elif draft == "near":
        assert 0 < totals["spec_accepted_tokens"] < totals["spec_draft_tokens"]
    if "retract" in name or "small-pool" in name:
        assert llm.scheduler.num_retractions > 0, "the small pool was meant to force preemption"
    # Reported per request, and summing to the scheduler's totals.
    assert sum(r["spec_verify_steps"] for r in out) == totals["spec_verify_steps"]
    assert sum(r["spec_accepted_tokens"] for r in out) == totals["spec_accepted_tokens"]


def test_same_model_draft_accepts_k_plus_one_per_step(tiny_models: dict[str, Path]) -> None:
    """Draft = target: each verify step emits K + 1 tokens, also after cache hits: the second
    round continues each conversation, so its cached prefix covers the first round's output,
    whose draft K/V must have come along (a stale draft slot would cost acceptances)."""
    path = str(tiny_models["llama"])
    llm = LLM(path, speculative_draft_model=path, speculative_num_steps=K)
    prompts = [list(range(10, 10 + n)) for n in (3, 17, 40)]
    steps = [2, 5, 7]  # max_tokens = 1 + steps * (K + 1): the prefill samples one token
    params = [
        SamplingParams(temperature=0, max_tokens=1 + s * (K + 1), ignore_eos=True) for s in steps
    ]
    for round_ in range(2):
        out = llm.generate(prompts, params)
        for r, p, s in zip(out, prompts, steps):
            assert r["spec_verify_steps"] == s
            assert r["spec_draft_tokens"] == r["spec_accepted_tokens"] == s * K
            assert r["spec_accept_length"] == K + 1
            # All but the last two tokens (no K/V; target K/V only) come from the cache.
            assert r["cached_tokens"] == (len(p) - 3 if round_ else 0)
        prompts = [p + r["token_ids"] + [7] for p, r in zip(prompts, out)]
    assert_engine_clean(llm)


def test_sampled_requests_keep_the_drafts_of_an_identical_model(
    tiny_models: dict[str, Path],
) -> None:
    """Sampling with draft = target: q equals p, so rejection sampling keeps (nearly) every
    draft. (Treating sampled drafts as deterministic would still be exact, but would keep
    only a fraction p(d) of them: this checks that the draft's q reaches the verifier.)"""
    path = str(tiny_models["llama"])
    llm = LLM(path, speculative_draft_model=path, speculative_num_steps=K)
    params = [
        SamplingParams(temperature=t, max_tokens=20, ignore_eos=True, seed=i)
        for i, t in enumerate([1.0, 0.7, 1.3, 0.0] * 3)
    ]
    out = llm.generate([[5, 6, 7], [9, 8], [40, 41, 42, 43]] * 4, params)
    assert all(len(r["token_ids"]) == 20 for r in out)
    totals = llm.scheduler.totals
    assert totals["spec_accepted_tokens"] >= 0.97 * totals["spec_draft_tokens"], totals
    # The same seed gives the same tokens whatever else is in the batch.
    alone = llm.generate([[5, 6, 7]], params[0])[0]["token_ids"]
    assert alone == out[0]["token_ids"]
    assert_engine_clean(llm)


def test_draft_model_validation(tiny_models: TinyModels) -> None:
    path = str(tiny_models["llama"])
    other_vocab = tiny_models.build("llama", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens, the target 256"):
        LLM(path, speculative_draft_model=str(other_vocab))
    with pytest.raises(ValueError, match="speculative_draft_model"):
        LLM(path, speculative_algorithm="draft")
    with pytest.raises(ValueError, match="speculative_draft_model"):
        LLM(path, speculative_algorithm="ngram", speculative_draft_model=path)
    assert (
        LLM(path).generate([[5, 6]], SamplingParams(max_tokens=2))[0].get("spec_verify_steps")
        is None
    )


def test_spec_metrics() -> None:
    """The speculative extension's metrics, rendered by the metrics extension: the totals
    from the scheduler's stats, and per finished request from its counters."""
    from prometheus_client.parser import text_string_to_metric_families

    from minisgl.extensions.metrics.prometheus import ServerMetrics
    from minisgl.extensions.speculative.server import METRICS
    from minisgl.ipc.messages import TextOutput

    m = ServerMetrics(METRICS)
    base = {"total_pages": 10, "free_pages": 10, "evictable_pages": 0, "running": 0}
    base |= {"waiting": 0, "prefix_hit_rate": 0.0}
    m.on_stats({**base, "spec_verify_steps": 4, "spec_draft_tokens": 12, "spec_accepted_tokens": 9})
    m.on_stats({**base, "spec_verify_steps": 6, "spec_draft_tokens": 18, "spec_accepted_tokens": 9})

    class Group:
        arrival, last_token_at = 0.0, {}  # type: ignore[var-annotated]

    counters = {"spec_verify_steps": 2, "spec_accepted_tokens": 4}
    done = TextOutput(rid=1, text="", token_ids=[], finish_reason="stop", counters=counters)
    m.on_output(Group(), done, 1.0)  # type: ignore[arg-type]
    samples = {
        s.name: s.value
        for fam in text_string_to_metric_families(m.render().decode())
        for s in fam.samples
    }
    assert samples["minisgl_spec_verify_steps_total"] == 6
    assert samples["minisgl_spec_draft_tokens_total"] == 18
    assert samples["minisgl_spec_accepted_tokens_total"] == 9
    assert samples["minisgl_spec_accept_length"] == 2.5
    assert samples["minisgl_spec_request_accept_length_sum"] == 3.0


@pytest.mark.parametrize("phase", ["mid_chunked_prefill", "decoding", "retracted"])
def test_abort_with_a_draft_model(tiny_models: dict[str, Path], phase: str) -> None:
    """Aborting (or retracting) a speculating request frees its pages once for both models;
    the other request's tokens, and every draft of the draft-equals-target model, stand."""
    path = str(tiny_models["llama"])
    llm = LLM(path, speculative_draft_model=path, speculative_num_steps=K, chunked_prefill_size=16)
    s = llm.scheduler
    victim = s.add_request(LONG, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    other = s.add_request(OTHER, GREEDY)
    ABORT_PHASES[phase](s, victim)
    s.check_integrity()
    assert s.abort(victim.uid) is victim
    step_until(s, lambda: other.finished)
    assert other.output_ids == LLM(path).generate([OTHER], GREEDY)[0]["token_ids"]
    assert s.totals["spec_accepted_tokens"] == s.totals["spec_draft_tokens"] > 0
    assert_engine_clean(llm)
