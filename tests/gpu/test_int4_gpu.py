"""GPU checks of 4-bit GPTQ/AWQ checkpoints (run through the device tool:
`python -m pytest tests/gpu/test_int4_gpu.py -m gpu`; the kernel checks of
tests/unit/test_int4_gemm.py run natively under the same marker).

On CUDA the linear layers keep the packed weights and run kernels/int4_gemm.py, whose
weights equal the dequantized checkpoint's rounded to bf16; the products differ from
cuBLAS's only in accumulation order, so the first tokens agree with the engine on the
dequantized float twin (later ones may part, as any two bf16 GEMMs' do).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams
from tests.conftest import assert_engine_clean
from tests.helpers import make_tiny_model
from tests.int4_checkpoints import write_quantized

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPTS = [[5, 6, 7], list(range(10, 90)), [42] * 17, [100, 101]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("int4gpu")
    # Wider than the CPU tiny model, so tiles cover several K steps and N blocks.
    src = make_tiny_model(
        root / "qwen2", "qwen2", hidden_size=256, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2, init_std=0.05,
    )  # fmt: skip
    return {
        "gptq": write_quantized(src, root / "gptq_q", root / "gptq_r", "gptq", 64),
        "awq": write_quantized(src, root / "awq_q", root / "awq_r", "awq", 128),
    }


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_int4_engine_matches_dequantized_bf16_graphs(
    checkpoints: dict[str, tuple[Path, Path]], method: str
) -> None:
    qpath, ref_path = checkpoints[method]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=True)
    ref = LLM(str(ref_path), dtype="bfloat16")
    want = ref.generate(PROMPTS, params)
    del ref
    llm = LLM(str(qpath), dtype="bfloat16")  # CUDA graphs on by default
    qkv = llm.engine.model.model.layers[0].self_attn.qkv_proj  # type: ignore[union-attr,index]
    assert qkv.int4_group > 0 and qkv.qweight.dtype == torch.int32, "int4 kernel not in use"
    got = llm.generate(PROMPTS, params)
    for g, w in zip(got, want):
        assert g["token_ids"][:4] == w["token_ids"][:4]
        assert abs(g["logprobs"][0] - w["logprobs"][0]) < 5e-2
    # Batch of one (decode graph at batch 1) gives the same first tokens as the batch.
    solo = llm.generate(PROMPTS[:1], params)[0]["token_ids"]
    assert solo[:4] == got[0]["token_ids"][:4]
    assert_engine_clean(llm)


def test_int4_fp32_matches_dequantized_exactly_in_tokens(
    checkpoints: dict[str, tuple[Path, Path]],
) -> None:
    """float32 (IEEE dot, no TF32): the kernel's product is the float product up to
    summation order, so every greedy token matches the dequantized twin."""
    qpath, ref_path = checkpoints["awq"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = LLM(str(ref_path), dtype="float32")
    want = [r["token_ids"] for r in ref.generate(PROMPTS, params)]
    del ref
    llm = LLM(str(qpath), dtype="float32")
    assert [r["token_ids"] for r in llm.generate(PROMPTS, params)] == want
