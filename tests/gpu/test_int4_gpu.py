"""GPU checks of 4-bit GPTQ/AWQ checkpoints (run through the device tool:
`python -m pytest tests/gpu/test_int4_gpu.py -m gpu`; the kernel checks of
tests/unit/extensions/quantization/test_int4_kernels.py run natively under the same marker).

On CUDA the linear layers keep the packed weights and run the quantization extension's
kernels/int4_gemm.py (or, for 1-4 rows, the GEMV of kernels/int4_gemv.py), whose weights equal the dequantized checkpoint's
rounded to bf16; the products differ from cuBLAS's only in accumulation order, so the first
tokens agree with the engine on the dequantized float twin (later ones may part, as any two
bf16 GEMMs' do). The GEMV and the GEMM use the same weights, so switching the GEMV off
(MINISGL_INT4_GEMV=0) leaves the first tokens as they are.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams, env
from minisgl.extensions.quantization import INT4_GEMV
from tests.helpers import assert_engine_clean, make_tiny_model
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
    assert qkv.quant is not None and qkv.qweight.dtype == torch.int32, "int4 kernel not in use"
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


def _gemv_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the int4 GEMV's launches (graph captures included: a launch recorded in a graph
    is counted once)."""
    from minisgl.extensions.quantization.kernels import int4_gemv

    calls: list[int] = []
    kernel = int4_gemv.int4_gemv

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(args[0].shape[0])  # type: ignore[attr-defined]
        return kernel(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(int4_gemv, "int4_gemv", counted)
    return calls


@pytest.mark.parametrize(
    ("dtype", "n_equal"), [("float32", 16), ("bfloat16", 4)], ids=["fp32", "bf16_graphs"]
)
def test_int4_gemv_on_equals_off(
    checkpoints: dict[str, tuple[Path, Path]],
    monkeypatch: pytest.MonkeyPatch,
    dtype: str,
    n_equal: int,
) -> None:
    """Greedy tokens with the batch-1 GEMV on equal those with the GEMM everywhere: fp32
    (IEEE products of the same weights, up to summation order) for all 16 tokens; bf16
    with CUDA graphs (on by default) for the first 4 and the first logprob. Prompts run
    one at a time and as a batch of 4, so decode steps of 1 and 4 rows take the GEMV."""
    qpath, _ = checkpoints["gptq"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=True)
    results = {}
    for enabled in (False, True):
        calls = _gemv_calls(monkeypatch)
        with env.override({INT4_GEMV: enabled}):  # the MINISGL_INT4_GEMV switch
            llm = LLM(str(qpath), dtype=dtype)
            solo = [llm.generate([p], params)[0] for p in PROMPTS]
            batch = llm.generate(PROMPTS, params)
        assert (len(calls) > 0) == enabled and all(r <= 4 for r in calls), calls
        if enabled:
            assert {1, 4} <= set(calls), sorted(set(calls))
        assert_engine_clean(llm)
        results[enabled] = solo + batch
        del llm
    for on, off in zip(results[True], results[False]):
        assert on["token_ids"][:n_equal] == off["token_ids"][:n_equal]
        assert abs(on["logprobs"][0] - off["logprobs"][0]) < (1e-3 if dtype == "float32" else 5e-2)
