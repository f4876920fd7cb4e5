"""GPU checks of FP8 checkpoints kept in e4m3 (run through the device tool:
`python -m pytest tests/gpu/test_fp8_gpu.py -m gpu`).

The kernels at Qwen3-8B's shapes, and the fused FP8 MoE at Qwen3-30B-A3B's expert shapes,
against the float64 product of the same activations and the dequantized weights
(tolerances from the accumulation: see test_fp8_kernels.py and test_fp8_moe.py, whose
small-shape checks run natively under the same marker); a tiny Qwen3 FP8 checkpoint
(block-wise 128 x 128) served with CUDA graphs, teacher-forced against its dequantized bf16
twin over 512 decode positions; and a tiny Qwen3-MoE FP8 checkpoint whose experts stay
e4m3, likewise (the FP8 MoE replayed in CUDA graphs).

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
from minisgl.extensions.quantization import (
    FP8_FUSED_ACT,
    FP8_GEMV,
    FP8_KERNELS,
    FP8_MOE_KERNELS,
)
from tests.fp8_checkpoints import write_fp8
from tests.helpers import assert_engine_clean, make_tiny_model, teacher_forced_agreement
from tests.unit.extensions.quantization.test_fp8_kernels import fp8_weights, gemm_case, gemv_case
from tests.unit.extensions.quantization.test_fp8_moe import assert_fp8_moe, fp8_moe_case

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


@pytest.mark.parametrize(("n", "k"), SHAPES_8B)
def test_cublas_fp8_gemm_8b_shapes(n: int, k: int) -> None:
    """cuBLASLt's block-scaled FP8 GEMM, which fp8_cuda routes 5+ rows of block-scaled
    weights to where this torch and CUDA run it (odd row counts padded to a multiple of 4),
    within the same bounds."""
    from minisgl.extensions.quantization.fp8_cuda import cublas_block_gemm_runs

    if not cublas_block_gemm_runs(CUDA):
        pytest.skip("this torch/CUDA build's _scaled_mm has no 1x128 x 128x128 scaling")
    for rows in (5, 8, 37, 64, 301, 2048):
        gemm_case(rows, n, k, 128, 128, torch.bfloat16, rows == 37, CUDA, cublas=True)


def test_cublas_norm_quantized_rows_pad() -> None:
    """The RMSNorm that quantizes into cuBLASLt's padded layout (fp8_cuda.fp8_norm_forward)
    gives the bits of the plain norm then cublas_fp8_gemm, at row counts that pad."""
    from minisgl.extensions.quantization import fp8_cuda
    from minisgl.extensions.quantization.kernels.fp8_gemm import cublas_fp8_gemm
    from minisgl.kernels.norm import fused_add_rms_norm

    if not fp8_cuda.cublas_block_gemm_runs(CUDA):
        pytest.skip("this torch/CUDA build's _scaled_mm has no 1x128 x 128x128 scaling")
    q, s, _ = fp8_weights(1024, 512, 128, 128, 4)
    layer = torch.nn.Module()
    fp8_cuda.set_fp8_buffers(layer, q.to(CUDA), s.to(CUDA))
    g = torch.Generator().manual_seed(5)
    w = (torch.rand(512, generator=g) + 0.5).bfloat16().to(CUDA)
    for rows in (5, 37, 301):
        x, r = ((torch.randn(rows, 512, generator=g) * 3).bfloat16().to(CUDA) for _ in range(2))
        got = fp8_cuda.fp8_norm_forward(layer, x, r, w, 1e-6, None)
        assert got is not None and got[0].shape == (rows, 1024)
        normed, res = fused_add_rms_norm(x, r, w, 1e-6)
        assert torch.equal(got[0], cublas_fp8_gemm(normed, q.to(CUDA), s.to(CUDA)))
        assert torch.equal(got[1], res)


@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("i", [768, 384], ids=["tp1", "tp2"])
def test_fp8_moe_30b_a3b_shapes(tokens: int, i: int) -> None:
    """Qwen3-30B-A3B's experts (128, top-8, hidden 2048, moe_intermediate 768 per rank at
    TP 1, 384 at TP 2), block scales 128 x 128."""
    case = fp8_moe_case(tokens, 128, 8, 2048, i, 128, 128, torch.bfloat16, CUDA, seed=tokens)
    assert_fp8_moe(case)


TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=2048)  # fmt: skip


def _decisive_fp8(root: Path, arch: str, **overrides: object) -> tuple[Path, Path]:
    """A tiny model made decisive (see above), as a block-wise FP8 checkpoint and its twin."""
    from safetensors.torch import load_file, save_file

    src = make_tiny_model(root / arch, arch, **TINY, **overrides)  # type: ignore[arg-type]
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


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _decisive_fp8(tmp_path_factory.mktemp("fp8gpu"), "qwen3")


@pytest.fixture(scope="module")
def fp8_moe_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Qwen3-MoE: layer 0 dense, layer 1 sparse (7 experts of 128 inputs, top-2)."""
    root = tmp_path_factory.mktemp("fp8moegpu")
    return _decisive_fp8(root, "qwen3_moe", moe_intermediate_size=128, num_experts=7)


PROMPT = list(range(10, 26))
GRAPHS = dict(dtype="bfloat16", cuda_graph_max_bs=4)  # CUDA graphs on, few to capture


def _twin_greedy(twin_path: Path) -> dict:
    """The bf16 twin's 512 greedy tokens and their logprobs."""
    params = SamplingParams(temperature=0, max_tokens=512, ignore_eos=True, logprobs=True)
    twin = LLM(str(twin_path), **GRAPHS)  # type: ignore[arg-type]
    out = twin.generate([PROMPT], params, use_tqdm=False)[0]
    twin.close()
    return out


@pytest.fixture(scope="module")
def twin_greedy(fp8_model: tuple[Path, Path]) -> dict:
    return _twin_greedy(fp8_model[1])


@pytest.mark.parametrize(
    ("gemv", "norm_gemv"), [(True, False), (True, True), (False, False)],
    ids=["gemv", "gemv_norm", "w8a8_gemm"],
)  # fmt: skip
def test_fp8_engine_teacher_forced_top1(
    fp8_model: tuple[Path, Path], twin_greedy: dict, gemv: bool, norm_gemv: bool
) -> None:
    """CUDA graphs on: batch-1 decode steps run the FP8 GEMV (weight-only; with
    the norm-in-GEMV fusion, the layers' pre-norms in its prologue), or with MINISGL_FP8_GEMV=0 the
    W8A8 GEMM; the prefills of the restarts the GEMM."""
    want = twin_greedy
    with env.override({FP8_GEMV: gemv}):
        options = dict(disable_fused_norm_gemv=not norm_gemv, **GRAPHS)
        llm = LLM(str(fp8_model[0]), **options)  # type: ignore[arg-type]
        qkv = llm.engine.model.model.layers[0].self_attn.qkv_proj  # type: ignore[union-attr,index]
        assert qkv.quant is not None and qkv.qweight.dtype == torch.float8_e4m3fn
        top1, diff = teacher_forced_agreement(llm, PROMPT, want["token_ids"], want["logprobs"])
    kind = ("GEMV + norm" if norm_gemv else "GEMV") if gemv else "W8A8 GEMM"
    print(f"fp8 {kind}: top-1 {top1:.4f}, mean |dlogprob| {diff:.4f}")
    assert top1 >= 0.99 and diff < 0.05, (top1, diff)
    assert_engine_clean(llm)


def test_fp8_fused_activations_same_tokens(fp8_model: tuple[Path, Path]) -> None:
    """The steps before the FP8 products fused into the kernels that read or make their
    input (SiLU-and-mul: the down projection's GEMV (the SiLU-in-down fusion), its quantizer with
    MINISGL_FP8_FUSED_ACT; the RMSNorm writing quantized activations for q/k/v and gate/up,
    MINISGL_FP8_FUSED_ACT) or run as their own kernels: the same greedy tokens, decoding one
    request (GEMV) and six (GEMM)."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    batches = [[PROMPT], [PROMPT[i:] for i in range(6)]]
    outs = []
    for fused in (True, False):
        with env.override({FP8_FUSED_ACT: fused}):
            options = dict(disable_fused_silu_down=not fused, **GRAPHS)
            llm = LLM(str(fp8_model[0]), **options)  # type: ignore[arg-type]
            mlp = llm.engine.model.model.layers[0].mlp  # type: ignore[union-attr,index]
            assert mlp.down_proj.fusing_quant is not None and mlp.silu_in_down == fused
            assert mlp.gate_up_proj.fusing_quant is not None
            outs.append([[o["token_ids"] for o in llm.generate(b, params, use_tqdm=False)]
                         for b in batches])  # fmt: skip
            assert_engine_clean(llm)
            llm.close()
    assert outs[0] == outs[1]


def test_fp8_moe_engine_keeps_e4m3_experts(fp8_moe_model: tuple[Path, Path]) -> None:
    """The sparse layer's experts stay e4m3 (the FP8 MoE kernel, in CUDA graphs for decode)
    and decode as the bf16 twin, teacher-forced; MINISGL_FP8_KERNELS=0 dequantizes them."""
    want = _twin_greedy(fp8_moe_model[1])
    with env.override({FP8_MOE_KERNELS: True}):
        llm = LLM(str(fp8_moe_model[0]), **GRAPHS)  # type: ignore[arg-type]
    moe = llm.engine.model.model.layers[1].mlp  # type: ignore[union-attr,index]
    assert moe.kernel_quant is not None and moe.w13.dtype == moe.w2.dtype == torch.float8_e4m3fn
    assert moe.w13_wscale.shape == (7, 2, 2) and moe.w2_wscale.shape == (7, 2, 1)
    top1, diff = teacher_forced_agreement(llm, PROMPT, want["token_ids"], want["logprobs"])
    print(f"fp8 MoE: top-1 {top1:.4f}, mean |dlogprob| {diff:.4f}")
    assert top1 >= 0.98 and diff < 0.05, (top1, diff)
    assert_engine_clean(llm)
    llm.close()
    with env.override({FP8_KERNELS: False, FP8_MOE_KERNELS: True}):
        off = LLM(str(fp8_moe_model[0]), **GRAPHS)  # type: ignore[arg-type]
    moe = off.engine.model.model.layers[1].mlp  # type: ignore[union-attr,index]
    assert moe.kernel_quant is None and moe.w13.dtype == torch.bfloat16
    off.close()
