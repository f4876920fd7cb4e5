"""HiCache end to end on the CPU: greedy tokens equal HiCache off under workloads that force
device eviction and host hits (page sizes 1 and 16, chunked prefill, preemption, overlap on
and off, write-back and write-through, aborts, TP=2), the host hits are reported, flush
empties both tiers, and bad options fail at startup naming the option."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from minisgl import LLM, SamplingParams
from minisgl.extensions.hicache.options import available_host_bytes
from tests.helpers import assert_engine_clean
from tests.workloads import check_abort_mix, run_abort_mix

# Six conversations of ~90-token histories, three turns: the working set outgrows the
# device pool of each variant, so earlier turns leave the device before they are reused.
BASE: dict[str, Any] = dict(chunked_prefill_size=256, num_pages=160)
VARIANTS: dict[str, dict[str, Any]] = {
    "page1": {},
    "page1-write-through": dict(hicache_write_policy="write_through"),
    "page16": dict(page_size=16, num_pages=12),
    "page16-chunk16-overlap": dict(page_size=16, num_pages=12, chunked_prefill_size=16, overlap=1),
    "chunk16": dict(chunked_prefill_size=16),
    "overlap": dict(overlap=True),
    # Longer outputs (max_tokens 24) that outgrow admission's guess: requests are retracted.
    "preempt": dict(num_pages=200, init_new_token_ratio=0.05, max_tokens=24),
    "preempt-overlap-chunk": dict(
        num_pages=200,
        init_new_token_ratio=0.05,
        chunked_prefill_size=32,
        overlap=True,
        max_tokens=24,
    ),
}


def conversations(
    llm: LLM, turns: int = 3, max_tokens: int = 4
) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Every turn's outputs, the conversations run side by side; and the last turn's results."""
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rng = random.Random(0)
    history = [[rng.randrange(3, 256) for _ in range(80)] for _ in range(6)]
    tokens: list[list[int]] = []
    results: list[dict[str, Any]] = []
    for _ in range(turns):
        results = llm.generate(history, greedy)
        for h, r in zip(history, results):
            tokens.append(r["token_ids"])
            h += r["token_ids"] + [rng.randrange(3, 256) for _ in range(6)]
        llm.scheduler.check_integrity()
    return tokens, results


def make_llm(path: Path, **options: Any) -> LLM:
    overlap = bool(options.pop("overlap", False))
    llm = LLM(str(path), **options)
    llm.scheduler.overlap = overlap
    return llm


@pytest.fixture(scope="module")
def references(tiny_models: dict[str, Path]) -> dict[int, list[list[int]]]:
    """HiCache off, a pool that never evicts: each max_tokens' tokens, made when asked."""

    class Refs(dict[int, list[list[int]]]):
        def __missing__(self, max_tokens: int) -> list[list[int]]:
            llm = make_llm(tiny_models["llama"], num_pages=4096)
            self[max_tokens] = conversations(llm, max_tokens=max_tokens)[0]
            return self[max_tokens]

    return Refs()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_outputs_identical_with_host_hits(
    tiny_models: dict[str, Path], references: dict[int, list[list[int]]], name: str
) -> None:
    options = {**BASE, **VARIANTS[name]}
    max_tokens = options.pop("max_tokens", 4)
    reference = references[max_tokens]  # HiCache off (and no eviction)
    on = make_llm(tiny_models["llama"], hicache_size=0.01, **options)
    tokens, last = conversations(on, max_tokens=max_tokens)
    assert tokens == reference
    totals = on.scheduler.totals
    assert totals["hicache_loaded_tokens"] > 0 and totals["hicache_bytes_to_host"] > 0, totals
    assert any(r["host_cached_tokens"] > 0 for r in last)
    assert all(r["cached_tokens"] >= r["host_cached_tokens"] for r in last)
    if name.startswith("preempt"):
        assert on.scheduler.num_retractions > 0, "the small pool was meant to force preemption"
    assert_engine_clean(on)


def test_host_hits_save_prefill(tiny_models: dict[str, Path]) -> None:
    """The same small pool, HiCache off then on: the same tokens, less prefill."""
    computed, outputs = {}, {}
    for size in (0.0, 0.01):
        llm = make_llm(tiny_models["llama"], hicache_size=size, **BASE)
        outputs[size] = conversations(llm)[0]
        computed[size] = llm.scheduler.prefill_tokens
    assert outputs[0.01] == outputs[0.0]
    assert computed[0.01] < 0.8 * computed[0.0], computed


def test_flush_empties_both_tiers(tiny_models: dict[str, Path]) -> None:
    llm = make_llm(tiny_models["llama"], hicache_size=0.01, **BASE)
    conversations(llm, turns=2)
    kv = llm.scheduler.kv
    assert kv.tier is not None and kv.tier.num_free_pages < kv.tier.num_pages
    assert llm.scheduler.flush_cache()
    llm.scheduler.check_integrity()
    assert kv.tier.num_free_pages == kv.tier.num_pages
    assert kv.allocator.num_free_pages == kv.allocator.num_pages


def test_aborts_with_host_hits(tiny_models: dict[str, Path]) -> None:
    """The abort mix (tests/workloads.py) with a pool too small for its shared prefixes,
    under overlap: survivors' tokens equal HiCache off without overlap; nothing leaks."""
    options = dict(chunked_prefill_size=64, page_size=4, num_pages=60)
    ref_llm = make_llm(tiny_models["qwen3"], **options)
    ref, ref_aborted = run_abort_mix(ref_llm, long_tokens=(6, 10))
    check_abort_mix(ref, ref_aborted, ref, overlap=False)
    for overlap in (False, True):
        llm = make_llm(tiny_models["qwen3"], hicache_size=0.01, overlap=overlap, **options)
        reqs, aborted = run_abort_mix(llm, long_tokens=(6, 10))
        check_abort_mix(reqs, aborted, ref, overlap=overlap)
        assert_engine_clean(llm)


def test_off_by_default(tiny_models: dict[str, Path]) -> None:
    llm = LLM(str(tiny_models["llama"]))
    assert llm.scheduler.kv.tier is None
    assert type(llm.scheduler.kv.cache).__name__ == "RadixCache"
    greedy = SamplingParams(temperature=0, max_tokens=2)
    assert "host_cached_tokens" not in llm.generate([[5, 6, 7]], greedy)[0]


@pytest.mark.parametrize(
    "options, error",
    [
        (dict(hicache_size=-1.0), "hicache_size=-1.0 is invalid: >= 0"),
        (dict(hicache_size=1e9), "hicache_size=1000000000.0 is invalid: at most the host's"),
        (dict(hicache_size=0.01, attention_backend="flashinfer"), "hicache_size=0.01 is invalid"),
        (dict(hicache_size=0.01, cache="naive"), "hicache_size=0.01 is invalid: needs cache"),
        (dict(hicache_write_policy="sometimes"), "hicache_write_policy='sometimes' is invalid"),
    ],
)
def test_bad_options_fail_at_startup(
    tiny_models: dict[str, Path], options: dict[str, Any], error: str
) -> None:
    with pytest.raises(ValueError, match=error.replace("(", r"\(")):
        LLM(str(tiny_models["llama"]), **options)


def test_more_than_available_memory_is_refused() -> None:
    from minisgl.config import EngineConfig

    gib = available_host_bytes() / 2**30 * 1.5
    with pytest.raises(ValueError, match="hicache_size=.* is invalid: at most the host's"):
        EngineConfig.from_kwargs(hicache_size=gib)


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("short_dist_timeout")
def test_tp2_outputs_identical(
    tiny_models: dict[str, Path], references: dict[int, list[list[int]]]
) -> None:
    """Each rank keeps its shard of the host tier; the tokens equal TP=1 without HiCache."""
    with LLM(str(tiny_models["llama"]), tp_size=2, hicache_size=0.01, **BASE) as llm:
        tokens, last = conversations(llm)
        assert tokens == references[4]
        assert any(r["host_cached_tokens"] > 0 for r in last)
        assert_engine_clean(llm)


def test_speculation(tiny_models: dict[str, Path]) -> None:
    """N-gram speculation (no K/V of its own) keeps its tokens with host hits; a draft model,
    whose K/V the host tier does not hold, is refused at startup."""
    path = str(tiny_models["llama"])
    llm = make_llm(tiny_models["llama"], hicache_size=0.01, speculative_algorithm="ngram", **BASE)
    tokens, _ = conversations(llm, turns=2)
    ref = make_llm(tiny_models["llama"], num_pages=4096)
    assert tokens == conversations(ref, turns=2)[0]
    assert llm.scheduler.totals["hicache_loaded_tokens"] > 0
    with pytest.raises(ValueError, match="speculative_draft_model is invalid with a host KV"):
        LLM(path, hicache_size=0.01, speculative_draft_model=path)


def test_reports() -> None:
    """What the server adds to usage / meta_info and what LLM results carry."""
    from minisgl.config import EngineConfig
    from minisgl.extensions.hicache.report import counter_report, usage_report

    report = usage_report([{"host_cached_tokens": 48}, {"host_cached_tokens": 32}])
    assert report is not None
    assert report.usage == report.meta_info == {"host_cached_tokens": 48}
    assert usage_report([{}]) is None
    assert counter_report(EngineConfig.from_kwargs(), {}) == {}
    on = EngineConfig.from_kwargs(hicache_size=0.01)
    assert counter_report(on, {}) == {"host_cached_tokens": 0}
