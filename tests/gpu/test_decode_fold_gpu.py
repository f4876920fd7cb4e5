"""GPU checks of q/k norm, RoPE and the K/V store folded into the decode kernel
(on unless ``--disable-fused-decode-rope``, kernels/decode_fold.py; device tool: `python -m
pytest tests/gpu -m gpu`).

The kernel checks run natively as tests/unit/kernels/test_decode_fold.py's ``test_on_gpu``
(folded launch against fused_qk_norm_rope_store + decode_attention). Here tiny random models
decode teacher-forced with the fold as without it: bf16 and fp32, graphs and eager,
an fp8 cache, head_dim 128 (the production tile); and the fold is taken.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams
from tests.helpers import assert_engine_clean, make_tiny_model, teacher_forced_agreement

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu_decode_fold")
    return {
        "qwen3": make_tiny_model(root / "qwen3", "qwen3", max_position_embeddings=2048),
        "qwen3_d128": make_tiny_model(
            root / "qwen3_d128", "qwen3", max_position_embeddings=2048, head_dim=128
        ),
        "llama": make_tiny_model(root / "llama", "llama", max_position_embeddings=2048),
    }


@pytest.mark.parametrize(
    ("model", "options"),
    [
        ("qwen3", dict(dtype="bfloat16")),
        ("qwen3", dict(dtype="float32")),
        ("qwen3", dict(dtype="bfloat16", cuda_graph_max_bs=0)),
        ("qwen3", dict(dtype="bfloat16", kv_cache_dtype="fp8_e4m3")),
        ("qwen3_d128", dict(dtype="bfloat16")),
        ("llama", dict(dtype="bfloat16")),
    ],
    ids=["bf16", "fp32", "bf16-eager", "bf16-fp8-cache", "d128", "llama"],
)
def test_fold_decodes_as_the_fused_store_teacher_forced(
    models: dict[str, Path], model: str, options: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch 1 over 256 tokens (the decode rows split, and the new token read back from the
    cache by the last chunk): the same top-1 but where a last-bit change flips a near-tie,
    logprobs within bf16 rounding; the folded launch is taken (counted as the layers call
    it, at graph capture too)."""
    from minisgl.attention import triton_backend

    prompt = list(range(10, 26))
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True, logprobs=True)
    ref_llm = LLM(
        str(models[model]),
        disable_fused_decode_rope=True,
        **options,  # type: ignore[arg-type]
    )
    ref = ref_llm.generate([prompt], params, use_tqdm=False)[0]
    ref_llm.close()
    decode, folds = triton_backend.decode_attention, []

    def counting(*args: object, **kw: object) -> torch.Tensor:
        folds.append(kw.get("fold") is not None)
        return decode(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_backend, "decode_attention", counting)
    llm = LLM(str(models[model]), **options)  # type: ignore[arg-type]
    assert getattr(llm.engine.attn_backend, "fused_decode_rope", False)
    top1, diff = teacher_forced_agreement(llm, prompt, ref["token_ids"], ref["logprobs"])
    print(f"fold {model} {options}: top-1 {top1:.4f}, mean |dlogprob| {diff:.5f}")
    assert any(folds), "the folded launch was not taken"
    assert top1 >= 0.97 and diff < 0.01, (top1, diff)
    assert_engine_clean(llm)
    llm.close()


def test_fold_with_many_rows(models: dict[str, Path]) -> None:
    """Many rows at once (decode batches up to 64: split and unsplit plans, graph padding
    rows): greedy tokens agree with the fused store's but where a near-tie flips."""
    prompts = [list(range(3 + i, 40 + 3 * i)) for i in range(48)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    runs = []
    for fold in (False, True):
        llm = LLM(str(models["qwen3"]), dtype="bfloat16", disable_fused_decode_rope=not fold)
        runs.append([r["token_ids"] for r in llm.generate(prompts, params, use_tqdm=False)])
        assert_engine_clean(llm)
        llm.close()
    # Tokens up to each row's first difference: a flip changes every later token.
    same = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
               for x, y in zip(*runs))  # fmt: skip
    assert same >= 0.8 * sum(len(x) for x in runs[0]), same
