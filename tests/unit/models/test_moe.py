"""Qwen3-MoE against transformers: the sparse MoE block, tiny random models' greedy tokens
and logprobs, TP shards of both checkpoint layouts (one tensor per expert, transformers 5's
packed experts), and the expert count of transformers 5's config. The fused kernel's own
checks are in tests/unit/kernels/test_moe.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from minisgl.distributed import TPInfo
from minisgl.layers.moe import SparseMoE
from minisgl.models.config import ModelConfig
from tests.helpers import TinyModels

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# Half precision: a few ulps of the output scale.
TOL = {F32: (1e-5, 1e-5), F16: (4e-3, 4e-3), BF16: (4e-2, 4e-2)}
PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18], [3] * 21, list(range(40, 73))]
N_NEW = 24


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("norm", [True, False])
def test_sparse_moe_block_matches_hf(dtype: torch.dtype, norm: bool) -> None:
    import transformers as tf

    hf_cfg = tf.Qwen3MoeConfig(
        hidden_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=norm,
    )
    torch.manual_seed(0)
    block = tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(hf_cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, 0.0, 0.1)
    cfg = ModelConfig.from_dict(
        {**hf_cfg.to_dict(), "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8}
    )
    ours = SparseMoE(cfg, TPInfo())
    ours.gate.weight.data.copy_(block.gate.weight)
    ours.w13.data.copy_(block.experts.gate_up_proj)
    ours.w2.data.copy_(block.experts.down_proj)
    x = torch.randn(1, 40, 64, generator=torch.Generator().manual_seed(1))
    block, ours, x = block.to(dtype), ours.to(dtype), x.to(dtype)
    with torch.no_grad():
        _close(ours(x[0]), block(x)[0], dtype)


def _build(path: Path, tp: TPInfo) -> torch.nn.Module:
    from minisgl.models.loader import iter_safetensors, load_weights
    from minisgl.models.registry import build_model

    cfg = ModelConfig.from_dir(path)
    with torch.device("cpu"):
        model = build_model(cfg, tp, cfg.max_position)
    load_weights(model, iter_safetensors(path, torch.device("cpu")))
    return model


def _save_packed(src: Path, dst: Path) -> Path:
    """Re-save with transformers 5's packed expert tensors instead of one per expert."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(src).save_pretrained(dst, save_original_format=False)
    for f in src.glob("tokenizer*"):
        shutil.copy(f, dst / f.name)
    shutil.copy(src / "config.json", dst / "config.json")  # keeps "num_experts"
    return dst


@pytest.fixture(scope="module")
def moe_ckpts(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from safetensors import safe_open

    per_expert = tiny_models.build("qwen3_moe", seed=2)
    packed = _save_packed(per_expert, tmp_path_factory.mktemp("moe") / "packed")
    with safe_open(str(per_expert / "model.safetensors"), "pt") as f:
        assert "model.layers.1.mlp.experts.7.down_proj.weight" in f.keys()  # noqa: SIM118
    with safe_open(str(packed / "model.safetensors"), "pt") as f:
        assert "model.layers.1.mlp.experts.gate_up_proj" in f.keys()  # noqa: SIM118
    return {"per_expert": per_expert, "packed": packed}


@pytest.mark.parametrize(
    "overrides",
    [{}, {"mlp_only_layers": [], "decoder_sparse_step": 2, "norm_topk_prob": False}],
    ids=["mlp_only_layers-normed", "sparse_step2-unnormed"],
)
def test_greedy_matches_hf(tiny_models: TinyModels, overrides: dict) -> None:
    from minisgl import LLM, SamplingParams
    from tests.helpers import assert_engine_clean, hf_greedy

    path = tiny_models.build("qwen3_moe", seed=1, **overrides)
    ref_tokens, ref_logprobs = hf_greedy(path, PROMPTS, N_NEW)
    llm = LLM(str(path))
    layers = llm.engine.model.model.layers  # type: ignore[attr-defined]
    assert [type(layer.mlp).__name__ for layer in layers] == ["GatedMLP", "SparseMoE"]
    params = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=True)
    for res, toks, lps in zip(llm.generate(PROMPTS, params), ref_tokens, ref_logprobs, strict=True):
        assert res["token_ids"] == toks
        assert max(abs(a - b) for a, b in zip(res["logprobs"], lps, strict=True)) < 1e-4
    assert_engine_clean(llm)


@pytest.mark.parametrize("fmt", ["per_expert", "packed"])
def test_tp_shards_concatenate_to_full(moe_ckpts: dict[str, Path], fmt: str) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(moe_ckpts[fmt]).model.layers[1].mlp
    full_w13, full_w2 = hf.experts.gate_up_proj.data, hf.experts.down_proj.data
    full = _build(moe_ckpts[fmt], TPInfo()).model.layers[1].mlp
    assert torch.equal(full.w13, full_w13) and torch.equal(full.w2, full_w2)
    shards = [_build(moe_ckpts[fmt], TPInfo(rank=r, size=2)).model.layers[1].mlp for r in (0, 1)]
    li = full_w2.shape[2] // 2
    assert all(s.w13.shape == (8, 2 * li, 64) and s.w2.shape == (8, 64, li) for s in shards)
    gate = torch.cat([s.w13[:, :li] for s in shards], dim=1)
    up = torch.cat([s.w13[:, li:] for s in shards], dim=1)
    assert torch.equal(torch.cat([gate, up], dim=1), full_w13)
    assert torch.equal(torch.cat([s.w2 for s in shards], dim=2), full_w2)
    for s in shards:  # the router is replicated
        assert torch.equal(s.gate.weight, hf.gate.weight)


def test_config_reads_transformers5_expert_count(moe_ckpts: dict[str, Path]) -> None:
    # transformers 5's save_pretrained writes the count as "num_local_experts" only.
    d = json.loads((moe_ckpts["per_expert"] / "config.json").read_text())
    d.pop("num_experts", None)
    assert d["num_local_experts"] == 8
    assert ModelConfig.from_dict(d).num_experts == 8
