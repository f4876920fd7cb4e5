"""FP8 KV cache (``kv_cache_dtype``): the pool's saturating store, its capacity and sizing,
the option's validation, and whole-engine runs on the CPU (torch backend, fp32 compute)
against Hugging Face transformers and against the model-dtype cache."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.cli import build_parser, engine_config
from minisgl.config import EngineConfig
from minisgl.kvcache.kv_dtype import kv_cache_dtype
from minisgl.kvcache.pool import KVPool
from tests.helpers import assert_engine_clean, hf_greedy, make_fp8_robust_llama

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
CPU = torch.device("cpu")


# ---------------------------------------------------------------- the pool
@pytest.mark.parametrize("dtype", FP8)
def test_pool_store_is_a_saturating_cast(dtype: torch.dtype) -> None:
    limit = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}[dtype]
    pool = KVPool(2, 5, 2, 2, 8, dtype, CPU)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(4, 2, 8, generator=g) * 3
    v = torch.randn(4, 2, 8, generator=g)
    # Past the finite max a plain cast gives NaN (e4m3fn) or inf (e5m2); the pool clamps.
    k[0, 0, :4] = torch.tensor([1e6, -1e6, limit * 1.01, -limit * 1.01])
    slots = torch.tensor([9, 0, 4, 5])
    pool.store(1, slots, k, v)
    got_k, got_v = pool.k(1)[slots].float(), pool.v(1)[slots].float()
    assert got_k[0, 0, :4].tolist() == [limit, -limit, limit, -limit]
    assert torch.isfinite(got_k).all() and torch.isfinite(got_v).all()
    # Elsewhere: exactly torch's cast (round to nearest even) of the clamped value.
    expect_k = k.clamp(-limit, limit).to(dtype).float()
    assert torch.equal(got_k, expect_k) and torch.equal(got_v, v.to(dtype).float())
    # fp8 really rounds: e4m3 keeps 3 mantissa bits, e5m2 2 (relative step 2^-3, 2^-2),
    # in the normal range (from 2^-6 and 2^-14 on; below, steps are absolute).
    normal = v.abs() > 2**-6
    rel = ((got_v - v).abs() / v.abs())[normal].max().item()
    assert 0 < rel <= {torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3}[dtype]
    # Other layers and slots are untouched.
    untouched = torch.ones(pool.num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert not pool.buffer[:, 0].float().any() and not pool.buffer[:, 1, untouched].float().any()


def test_fp8_pool_holds_twice_the_tokens_per_byte_of_bf16() -> None:
    def bytes_per_token(dtype: torch.dtype) -> float:
        pool = KVPool(3, 7, 16, 4, 64, dtype, CPU)
        per_page = KVPool.bytes_per_page(3, 16, 4, 64, dtype)
        assert pool.buffer.numel() * pool.buffer.element_size() == per_page * 7
        return per_page / 16

    assert bytes_per_token(torch.bfloat16) == 2 * bytes_per_token(torch.float8_e4m3fn)
    assert bytes_per_token(torch.float8_e5m2) == bytes_per_token(torch.float8_e4m3fn)
    assert bytes_per_token(torch.float32) == 4 * bytes_per_token(torch.float8_e5m2)


@pytest.fixture(scope="module")
def llama(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


@pytest.mark.parametrize("model_dtype", ["bfloat16", "float32"])
def test_pool_sizing_fits_more_fp8_pages_in_the_same_budget(llama: Path, model_dtype: str) -> None:
    # 8 MiB: the budget, not max_running_requests x context, bounds every pool here.
    pages = {}
    for kv in ("auto", "fp8_e4m3", "fp8_e5m2"):
        llm = LLM(str(llama), dtype=model_dtype, kv_cache_dtype=kv, cpu_kv_cache_gb=2**-7)
        pages[kv] = llm.engine.pool.num_pages
        want = {"auto": llm.engine.dtype, "fp8_e4m3": FP8[0], "fp8_e5m2": FP8[1]}[kv]
        assert llm.engine.pool.dtype == want == llm.engine.pool.buffer.dtype
        llm.close()
    ratio = {"bfloat16": 2, "float32": 4}[model_dtype]
    # budget // per_page for each: equal up to the floor's one page.
    assert abs(pages["fp8_e4m3"] - ratio * pages["auto"]) < ratio
    assert pages["fp8_e5m2"] == pages["fp8_e4m3"]


# ---------------------------------------------------------------- the option
def test_kv_cache_dtype_values() -> None:
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn  # vLLM's spelling
    assert kv_cache_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert kv_cache_dtype("fp8_e5m2", torch.float16) == torch.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        kv_cache_dtype("int8", torch.bfloat16)


@pytest.mark.parametrize("bad", ["fp16", "e4m3", "FP8", ""])
def test_bad_kv_cache_dtype_names_the_option(bad: str, llama: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(llama), kv_cache_dtype=bad)


def test_cli_flag(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["--kv-cache-dtype", "fp8_e5m2"])
    assert engine_config(args).kv_cache_dtype == "fp8_e5m2"
    assert engine_config(build_parser().parse_args([])).kv_cache_dtype == "auto"
    from minisgl.cli import main

    with pytest.raises(SystemExit):
        main(["--kv-cache-dtype", "fp4"])
    assert "kv_cache_dtype='fp4' is invalid" in capsys.readouterr().err


# ---------------------------------------------------------------- whole engine (CPU)
@pytest.fixture(scope="module")
def robust_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_fp8_robust_llama(tmp_path_factory.mktemp("fp8") / "robust")


def _prompts() -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(5, 40))] for _ in range(4)]


def _run(path: Path, kv: str, prompts: list[list[int]], **kw: object) -> list[dict]:
    llm = LLM(str(path), kv_cache_dtype=kv, **kw)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate(prompts, params, use_tqdm=False)
    assert_engine_clean(llm)
    llm.close()
    return out


@pytest.fixture(scope="module")
def hf_reference(robust_llama: Path) -> list[list[int]]:
    return hf_greedy(robust_llama, _prompts(), 12)[0]


def _prompt_lps(out: list[dict]) -> torch.Tensor:
    # Entry 0 of each prompt's list has no logprob (nothing predicts the first token).
    return torch.tensor([lp for o in out for lp in o["prompt_logprobs"][1:]])


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_fp8_greedy_matches_hf_and_logprobs_stay_close(
    robust_llama: Path, hf_reference: list[list[int]], kv: str, page_size: int
) -> None:
    prompts = _prompts()
    # Small prefill chunks and 2 slots: chunked prefill and mixed batches read fp8 K/V back.
    kw = {"page_size": page_size, "chunked_prefill_size": 16, "max_running_requests": 2}
    auto = _run(robust_llama, "auto", prompts, **kw)
    fp8 = _run(robust_llama, kv, prompts, **kw)
    assert [o["token_ids"] for o in auto] == hf_reference  # the fp32 cache: exact
    for o, ref in zip(fp8, hf_reference):
        assert o["token_ids"][:8] == ref[:8]
    diff = (_prompt_lps(fp8) - _prompt_lps(auto)).abs()
    # Non-zero: the pool really rounded to fp8. Bounded well below what K/V off by 25%
    # gives in this model (0.05; see make_fp8_robust_llama).
    assert diff.max() > 1e-5
    assert diff.max() < 0.02 and diff.mean() < 0.005


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_radix_hits_reuse_fp8_prefixes(robust_llama: Path, kv: str) -> None:
    """A request behind a cached fp8 prefix gives the tokens of a cold run (the prefix's K/V
    are read back from the pool, not recomputed; fp8 both times)."""
    import random

    rng = random.Random(3)
    system = [rng.randrange(3, 256) for _ in range(40)]
    tails = [[rng.randrange(3, 256) for _ in range(n)] for n in (3, 9)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    cold = []
    for tail in tails:  # one fresh engine per prompt: nothing cached
        llm = LLM(str(robust_llama), kv_cache_dtype=kv, page_size=4)
        cold.append(llm.generate([system + tail], params, use_tqdm=False)[0]["token_ids"])
        llm.close()
    llm = LLM(str(robust_llama), kv_cache_dtype=kv, page_size=4)
    first = llm.generate([system + tails[0]], params, use_tqdm=False)[0]
    second = llm.generate([system + tails[1]], params, use_tqdm=False)[0]
    assert first["cached_tokens"] == 0 and second["cached_tokens"] >= 36  # whole pages
    assert [first["token_ids"], second["token_ids"]] == cold
    assert_engine_clean(llm)
    llm.close()


def test_fp8_pool_is_logged(llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="minisgl.engine.engine"):
        LLM(str(llama), kv_cache_dtype="fp8", num_pages=64).close()
    assert "float8_e4m3fn" in caplog.text
