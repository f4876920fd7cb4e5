"""GPU checks of FP8 checkpoints kept in e4m3 (run through the device tool:
`python -m pytest tests/gpu/test_fp8_gpu.py -m gpu`).

The kernels at Qwen3-8B's shapes against the float64 product of the same activations and
the dequantized weights (tolerances from the accumulation: see test_fp8_kernels.py, whose
small-shape checks run natively under the same marker); and a tiny Qwen3 FP8 checkpoint
(block-wise 128 x 128) served with CUDA graphs, teacher-forced against its dequantized bf16
twin over 512 decode positions.

Decisive logits: a random tiny model's top-2 logits are close (bf16 against float32 alone
flips ~4% of its argmaxes, W8A8 activation rounding ~13%, measured on CPU), so the model is
made decisive: embeddings scaled up 16x (the residual stream carries the token) and the LM
head given a permuted copy of the embedding rows (a next-token map the layers perturb).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams, env
from minisgl.extensions.quantization import FP8_GEMV
from tests.fp8_checkpoints import write_fp8
from tests.helpers import assert_engine_clean, make_tiny_model
from tests.unit.extensions.quantization.test_fp8_kernels import gemm_case, gemv_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SHAPES_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]  # qkv, o, gate_up, down
CUDA = torch.device("cuda")


@pytest.mark.parametrize(("n", "k"), SHAPES_8B)
def test_fp8_gemv_8b_shapes(n: int, k: int) -> None:
    for rows in (1, 2, 4):
        gemv_case(rows, n, k, 128, 128, torch.bfloat16, False, CUDA)


@pytest.mark.parametrize(("n", "k"), SHAPES_8B)
def test_fp8_gemm_8b_shapes(n: int, k: int) -> None:
    for rows in (5, 64, 300):
        gemm_case(rows, n, k, 128, 128, torch.bfloat16, False, CUDA)


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("fp8gpu")
    src = make_tiny_model(
        root / "qwen3", "qwen3", hidden_size=256, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
    )  # fmt: skip
    w = load_file(str(src / "model.safetensors"))
    emb = w["model.embed_tokens.weight"]
    perm = torch.randperm(emb.shape[0], generator=torch.Generator().manual_seed(1))
    head = w["lm_head.weight"]
    w["lm_head.weight"] = (
        head + emb[perm] / emb.norm(dim=1, keepdim=True) * head.norm(dim=1)[:, None]
    )
    w["model.embed_tokens.weight"] = emb * 16
    save_file(w, str(src / "model.safetensors"), metadata={"format": "pt"})
    return write_fp8(src, root / "fp8", root / "ref", "block", block=(128, 128))


def _agreement(
    llm: LLM, prompt: list[int], ref: list[int], ref_lp: list[float]
) -> tuple[float, float]:
    """Teacher-forced greedy decoding: from ``prompt`` + ``ref``[:pos], generate until the
    first token that differs from ``ref``, count it, restart after it. (top-1 agreement,
    mean |chosen-token logprob difference| where they agree)."""
    agree, pos, diffs = 0, 0, []
    while pos < len(ref) and pos - agree <= len(ref) // 20:
        params = SamplingParams(
            temperature=0, max_tokens=len(ref) - pos, ignore_eos=True, logprobs=True
        )
        out = llm.generate([prompt + ref[:pos]], params, use_tqdm=False)[0]
        same = next(
            (i for i, (a, b) in enumerate(zip(out["token_ids"], ref[pos:])) if a != b),
            len(out["token_ids"]),
        )
        diffs += [abs(a - b) for a, b in zip(out["logprobs"][:same], ref_lp[pos : pos + same])]
        agree, pos = agree + same, pos + same + 1
    return agree / len(ref), sum(diffs) / max(len(diffs), 1)


PROMPT = list(range(10, 26))
GRAPHS = dict(dtype="bfloat16", cuda_graph_max_bs=4)  # CUDA graphs on, few to capture


@pytest.fixture(scope="module")
def twin_greedy(fp8_model: tuple[Path, Path]) -> dict:
    """The bf16 twin's 512 greedy tokens and their logprobs."""
    params = SamplingParams(temperature=0, max_tokens=512, ignore_eos=True, logprobs=True)
    twin = LLM(str(fp8_model[1]), **GRAPHS)  # type: ignore[arg-type]
    out = twin.generate([PROMPT], params, use_tqdm=False)[0]
    twin.close()
    return out


@pytest.mark.parametrize("gemv", [True, False], ids=["gemv", "w8a8_gemm"])
def test_fp8_engine_teacher_forced_top1(
    fp8_model: tuple[Path, Path], twin_greedy: dict, gemv: bool
) -> None:
    """CUDA graphs on: batch-1 decode steps run the FP8 GEMV (weight-only), or with
    MINISGL_FP8_GEMV=0 the W8A8 GEMM; the prefills of the restarts the GEMM."""
    want = twin_greedy
    with env.override({FP8_GEMV: gemv}):
        llm = LLM(str(fp8_model[0]), **GRAPHS)  # type: ignore[arg-type]
        qkv = llm.engine.model.model.layers[0].self_attn.qkv_proj  # type: ignore[union-attr,index]
        assert qkv.quant is not None and qkv.qweight.dtype == torch.float8_e4m3fn
        top1, diff = _agreement(llm, PROMPT, want["token_ids"], want["logprobs"])
    print(f"fp8 {'GEMV' if gemv else 'W8A8 GEMM'}: top-1 {top1:.4f}, mean |dlogprob| {diff:.4f}")
    assert top1 >= 0.99 and diff < 0.05, (top1, diff)
    assert_engine_clean(llm)
