"""GPU checks for the fused q/k-norm + RoPE + KV-store kernel (device tool:
`python -m pytest tests/gpu -m gpu`).

The kernel checks of tests/unit/kernels/test_qk_rope_store.py run natively here (bit-identical to
the unfused kernels on real hardware, where rounding and reduction order are the
compiler's); and greedy tokens of tiny random models are identical with the fusion on and
off: Qwen3 (q/k norm) and Llama (no norm), fp32 and bf16, eager and CUDA graphs, with a
draft model and Qwen3-MoE.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams
from tests.helpers import assert_engine_clean, make_tiny_model, perturbed_copy
from tests.kernel_checks import Skip
from tests.unit.kernels.test_qk_rope_store import CHECKS
from tests.workloads import shared_prefix_workload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_kernel_checks_on_gpu(name: str) -> None:
    try:
        CHECKS[name](torch.device("cuda"))
    except Skip as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu_fused_rope")
    qwen3 = make_tiny_model(root / "qwen3", "qwen3", max_position_embeddings=2048)
    return {
        "qwen3": qwen3,
        # head_dim 128: the production tile (16 x 128) of the q/k norm reduction.
        "qwen3_d128": make_tiny_model(
            root / "qwen3_d128", "qwen3", max_position_embeddings=2048, head_dim=128
        ),
        "llama": make_tiny_model(root / "llama", "llama", max_position_embeddings=2048),
        "qwen3_moe": make_tiny_model(root / "moe", "qwen3_moe", max_position_embeddings=2048),
        "draft": perturbed_copy(qwen3, root / "draft", scale=0.01),
    }


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    return shared_prefix_workload(11, 16, 200, 150, 48)


def _greedy(path: Path, fused: bool, **options: object) -> list[list[int]]:
    prompts, params = _workload()
    # The fold into decode attention sums 1 / rms in its own order (checked teacher-forced
    # in test_decode_fold_gpu.py): off here, so the store kernel alone is compared.
    options = dict(disable_fused_decode_rope=True, **options)
    llm = LLM(str(path), disable_fused_rope_store=not fused, **options)  # type: ignore[arg-type]
    assert llm.engine.attn_backend.fused_kv_store == fused
    draft = getattr(llm.scheduler.speculator, "draft", None)  # a draft model's own engine
    if draft is not None:
        assert draft.attn_backend.fused_kv_store == fused
    out = [r["token_ids"] for r in llm.generate(prompts, params)]
    assert_engine_clean(llm)
    llm.close()
    return out


@pytest.mark.parametrize("model", ["qwen3", "qwen3_d128", "llama"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_fusion_does_not_change_greedy(
    models: dict[str, Path], model: str, dtype: str, graphs: bool
) -> None:
    options: dict[str, object] = dict(dtype=dtype)
    if not graphs:
        options["cuda_graph_max_bs"] = 0
    on = _greedy(models[model], True, **options)
    off = _greedy(models[model], False, **options)
    assert on == off


def test_fusion_does_not_change_greedy_moe(models: dict[str, Path]) -> None:
    assert _greedy(models["qwen3_moe"], True) == _greedy(models["qwen3_moe"], False)


def test_fusion_with_draft_model(models: dict[str, Path]) -> None:
    """The draft engine is built from the same config: it fuses (or not) like the target."""
    options: dict[str, object] = dict(dtype="float32", speculative_draft_model=str(models["draft"]))
    on = _greedy(models["qwen3"], True, **options)
    off = _greedy(models["qwen3"], False, **options)
    assert on == off == _greedy(models["qwen3"], True, dtype="float32")
