"""GPU checks (run through the device tool: `python -m pytest tests/gpu -m gpu`).

Greedy outputs of a tiny random model equal Hugging Face transformers on the GPU; the
triton and torch attention backends agree; CUDA graphs and overlap scheduling on/off give
identical greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams, env
from tests.helpers import assert_engine_clean, make_tiny_model, teacher_forced_agreement
from tests.workloads import shared_prefix_workload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("gpu") / "qwen3", "qwen3", max_position_embeddings=2048
    )


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    return shared_prefix_workload(3, 24, 300, 200, 64)


def _hf_greedy(path: Path, prompts: list[list[int]], n: int, dtype: torch.dtype) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    out = []
    for ids in prompts:
        g = model.generate(
            torch.tensor([ids], device="cuda"),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        out.append(g[0, len(ids) :].tolist())
    return out


def test_matches_hf_on_gpu_fp32(tiny: Path) -> None:
    prompts = [[5, 6, 7], list(range(10, 90)), [42] * 17]
    ref = _hf_greedy(tiny, prompts, 24, torch.float32)
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny), dtype="float32", attention_backend=backend)
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        assert [r["token_ids"] for r in out] == ref, backend
        assert_engine_clean(llm)


@pytest.mark.parametrize(
    "options",
    [
        dict(attention_backend="torch", cuda_graph_max_bs=0, disable_overlap_scheduling=True),
        dict(attention_backend="triton", cuda_graph_max_bs=0, disable_overlap_scheduling=True),
        dict(attention_backend="triton", cuda_graph_max_bs=0),
        dict(attention_backend="triton", disable_overlap_scheduling=True),
        dict(attention_backend="triton"),
        dict(attention_backend="triton", page_size=16),
        dict(attention_backend="triton", chunked_prefill_size=64, cache="naive"),
        dict(attention_backend="triton", chunked_prefill_size=96),
        dict(attention_backend="triton", chunked_prefill_size=96, cuda_graph_max_tokens=0),
        dict(attention_backend="triton", chunked_prefill_size=300, page_size=16),
        # Prefill graphs of up to 2,048 tokens over rows of at most 1,024 (capture split).
        dict(attention_backend="triton", context_length=1024),
    ],
    ids=[
        "torch-eager-sync",
        "triton-eager-sync",
        "triton-eager-overlap",
        "triton-graph-sync",
        "triton-graph-overlap",
        "page16",
        "chunk64-naive",
        "mixed-graphs",
        "mixed-eager",
        "mixed-graphs-page16",
        "short-context-graphs",
    ],
)
def test_switches_do_not_change_greedy_fp32(tiny: Path, options: dict) -> None:
    prompts, params = _workload()
    base = LLM(
        str(tiny),
        dtype="float32",
        attention_backend="torch",
        cuda_graph_max_bs=0,
        disable_overlap_scheduling=True,
        cache="naive",
    )
    ref = [r["token_ids"] for r in base.generate(prompts, params)]
    llm = LLM(str(tiny), dtype="float32", **options)
    out = [r["token_ids"] for r in llm.generate(prompts, params)]
    assert out == ref
    assert_engine_clean(llm)
    runner = llm.engine.graph_runner
    if runner is not None and options.get("chunked_prefill_size", 8192) <= 300:
        # Every prefill chunk fits a prefill/mixed graph: they must really have replayed.
        graphs_on = options.get("cuda_graph_max_tokens") != 0
        assert (runner.replays["extend"] > 0) == graphs_on, runner.replays


def test_bf16_graphs_and_overlap_identical(tiny: Path) -> None:
    """bf16 (the CUDA default): graphs/overlap on vs off must agree exactly."""
    prompts, params = _workload()
    outs = []
    for opts in (dict(cuda_graph_max_bs=0, disable_overlap_scheduling=True), {}):
        llm = LLM(str(tiny), **opts)
        outs.append([r["token_ids"] for r in llm.generate(prompts, params)])
        assert_engine_clean(llm)
    assert outs[0] == outs[1]


def test_bf16_mixed_graphs_identical(tiny: Path) -> None:
    """bf16, small prefill chunks (every prefill/mixed step fits a graph): graphs on vs off.
    (Only the same chunk size is comparable: a different one changes the GEMM shapes.)"""
    prompts, params = _workload()
    outs, replays = [], []
    for opts in (dict(cuda_graph_max_bs=0, disable_overlap_scheduling=True), {}):
        llm = LLM(str(tiny), chunked_prefill_size=128, **opts)
        outs.append([r["token_ids"] for r in llm.generate(prompts, params)])
        assert_engine_clean(llm)
        runner = llm.engine.graph_runner
        replays.append(runner.replays["extend"] if runner is not None else 0)
    assert replays[1] > 0
    assert outs[0] == outs[1]


def test_exact_max_tokens_and_eos_under_overlap(tiny: Path) -> None:
    llm = LLM(str(tiny), dtype="float32")
    assert llm.scheduler.overlap
    full = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[
        0
    ]["token_ids"]
    for n in (1, 2, 7):
        r = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[
            0
        ]
        assert r["token_ids"] == full[:n]
    stop = full[6]
    r = llm.generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop])
    )[0]
    assert r["token_ids"] == full[: full.index(stop) + 1]  # nothing after the stop token
    assert_engine_clean(llm)


def test_batch1_gemv_layers_match_cublas(tiny: Path) -> None:
    """bf16 on CUDA: one-row products of the loaded model run the Triton GEMV (tiles set at
    load) and equal cuBLAS's up to bf16 rounding; MINISGL_TRITON_GEMV=0's path has none."""
    from minisgl.layers.cpu_linear import pack_model

    llm = LLM(str(tiny))
    layers = [m for m in llm.engine.model.modules() if getattr(m, "gemv_tiles", None)]
    assert layers, "no layer took the GEMV"
    for m in layers:
        x = torch.randn(1, m.weight.shape[1], device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x, m.weight, getattr(m, "bias", None))
        got = m(x) if not hasattr(m, "compute_logits") else m.compute_logits(x)
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    pack_model(llm.engine.model, gemv=False)  # what TRITON_GEMV off loads
    assert not any(getattr(m, "gemv_tiles", None) for m in llm.engine.model.modules())


def test_pdl_on_off_identical(tiny: Path) -> None:
    """bf16, graphs and overlap: kernels launched with programmatic dependent launch (the
    default on Hopper) give exactly the tokens of plain stream-ordered launches."""
    from minisgl.kernels import pdl

    prompts, params = _workload()
    outs = []
    for flag in (False, True):
        with env.override({env.PDL: flag}):
            pdl.pdl_enabled.cache_clear()
            assert pdl.pdl_enabled() == (flag and torch.cuda.get_device_capability()[0] >= 9)
            llm = LLM(str(tiny), chunked_prefill_size=128)
            outs.append([r["token_ids"] for r in llm.generate(prompts, params)])
            assert_engine_clean(llm)
    pdl.pdl_enabled.cache_clear()
    assert outs[0] == outs[1]


def test_silu_down_fusion_identical(tiny: Path) -> None:
    """bf16, one request at a time (the batch-1 GEMV; graphs, overlap): SiLU-and-mul inside
    down_proj's GEMV gives exactly the tokens of the separate kernel, and is taken."""
    from minisgl.models.decoder_layer import GatedMLP

    prompts, params = _workload()
    outs = []
    for disable in (True, False):
        llm = LLM(str(tiny), disable_fused_silu_down=disable)
        mlps = [m for m in llm.engine.model.modules() if isinstance(m, GatedMLP)]
        assert mlps and all(m.down_proj.gemv_tiles is not None for m in mlps)
        assert all(m.silu_in_down == (not disable) for m in mlps)
        outs.append(
            [llm.generate([p], [sp])[0]["token_ids"] for p, sp in zip(prompts[:8], params[:8])]
        )
        assert_engine_clean(llm)
    assert outs[0] == outs[1]


def test_norm_gemv_fusion_teacher_forced(tiny: Path) -> None:
    """bf16, batch 1 (graphs, overlap): the pre-norms inside the q/k/v and gate/up GEMVs (1 /
    rms summed in another order) decode as the separate norm kernels, teacher-forced over
    256 tokens: the same top-1 but where a last-bit change can flip a near-tie, logprobs
    within bf16 rounding; and the fused path is taken."""
    from minisgl.models.decoder_layer import DecoderLayer

    prompt = list(range(10, 26))
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True, logprobs=True)
    ref_llm = LLM(str(tiny), disable_fused_norm_gemv=True)
    ref = ref_llm.generate([prompt], params, use_tqdm=False)[0]
    ref_llm.close()
    llm = LLM(str(tiny))  # the fusion is on by default
    layers = [m for m in llm.engine.model.modules() if isinstance(m, DecoderLayer)]
    assert layers and all(m.norm_in_gemv for m in layers)
    assert all(m.self_attn.qkv_proj.gemv_tiles is not None for m in layers)
    top1, diff = teacher_forced_agreement(llm, prompt, ref["token_ids"], ref["logprobs"])
    print(f"norm in GEMV: top-1 {top1:.4f}, mean |dlogprob| {diff:.5f}")
    assert top1 >= 0.97 and diff < 0.01, (top1, diff)
    assert_engine_clean(llm)


def test_structured_output_on_gpu(tiny: Path) -> None:
    """Constrained rows (bf16 logits masked on the device) next to free ones: with CUDA graphs
    and overlap scheduling (constrained batches read back before the next launch) the tokens
    equal those of eager, non-overlapped runs, and each constrained row follows its regex
    (the tiny tokenizer's words are t3, t4, ...; then EOS, id 2)."""
    pytest.importorskip("xgrammar")
    prompts = [[5, 6, 7], [8, 9], list(range(10, 60)), [11, 12]]
    params = [
        SamplingParams(temperature=0, max_tokens=8, regex="t1[0-9]t2[0-9]"),
        SamplingParams(temperature=0.9, seed=7, max_tokens=8, regex="(t1[0-9]){2,3}"),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=8, regex="t1[0-9]t2[0-9]"),
    ]
    runs = []
    for options in (dict(), dict(cuda_graph_max_bs=0, disable_overlap_scheduling=True)):
        llm = LLM(str(tiny), dtype="bfloat16", **options)  # type: ignore[arg-type]
        runs.append([r["token_ids"] for r in llm.generate(prompts, params)])
        assert_engine_clean(llm)
        llm.close()
    assert runs[0] == runs[1]
    first, second, _, fourth = runs[0]
    for ids in (first, fourth):
        assert 10 <= ids[0] <= 19 and 20 <= ids[1] <= 29 and ids[2:] == [2], ids
    assert 2 <= len(second) - 1 <= 3 and second[-1] == 2
    assert all(10 <= t <= 19 for t in second[:-1]), second
