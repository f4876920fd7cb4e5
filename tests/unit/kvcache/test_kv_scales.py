"""Per-tensor K/V scales of an fp8 cache read from a checkpoint (kvcache/kv_scales.py): the
names vLLM reads, and a whole engine on the CPU whose checkpoint carries scales."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.kvcache.kv_scales import KVScales, kv_scale_name
from tests.helpers import make_fp8_robust_llama


def test_names() -> None:
    assert kv_scale_name("model.layers.3.self_attn.k_scale") == (3, "k")
    assert kv_scale_name("model.layers.0.self_attn.v_scale") == (0, "v")
    assert kv_scale_name("model.layers.12.self_attn.k_proj.output_scale") == (12, "k")
    assert kv_scale_name("model.layers.1.self_attn.v_proj.output_scale") == (1, "v")
    assert kv_scale_name("model.layers.2.self_attn.kv_scale") == (2, "kv")
    assert kv_scale_name("model.layers.2.self_attn.attn.v_scale") == (2, "v")
    for other in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.input_scale",
                  "model.layers.0.self_attn.k_proj.weight_scale", "model.norm.weight"):  # fmt: skip
        assert kv_scale_name(other) is None


def test_take_keeps_the_scales_and_passes_the_rest() -> None:
    weights = [
        ("model.layers.0.self_attn.k_scale", torch.tensor(0.5)),
        ("model.layers.0.self_attn.k_proj.weight", torch.ones(2, 2)),
        ("model.layers.1.self_attn.kv_scale", torch.tensor([0.25, 2.0])),  # per head: the max
    ]
    scales = KVScales()
    rest = list(scales.take(iter(weights)))
    assert [n for n, _ in rest] == ["model.layers.0.self_attn.k_proj.weight"]
    k, v = [1.0] * 3, [1.0] * 3
    scales.apply(k, v)
    assert k == [0.5, 2.0, 1.0] and v == [1.0, 2.0, 1.0]
    with pytest.raises(ValueError, match="positive"):
        list(KVScales().take(iter([("model.layers.0.self_attn.v_scale", torch.tensor(0.0))])))


@pytest.fixture(scope="module")
def scaled_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from safetensors.torch import load_file, save_file

    path = make_fp8_robust_llama(tmp_path_factory.mktemp("scales") / "robust")
    weights = load_file(str(path / "model.safetensors"))
    layers = {int(n.split(".")[2]) for n in weights if n.startswith("model.layers.")}
    for i in layers:  # powers of two: the stored codes are the unscaled ones times 4 / 0.25
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.25)
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(4.0)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _run(path: Path, kv: str) -> tuple[list[dict], LLM]:
    llm = LLM(str(path), kv_cache_dtype=kv, chunked_prefill_size=16, max_running_requests=2)
    prompts = [[5 + (7 * i + j) % 200 for j in range(20 + 5 * i)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    return llm.generate(prompts, params, use_tqdm=False), llm


def test_checkpoint_scales_reach_the_pool_and_are_undone_on_read(scaled_llama: Path) -> None:
    """The cache holds K * 4 and V / 4 (fp8 codes shift by whole exponents) and reading
    multiplies back: the same tokens and prompt logprobs as a run that ignores the scales
    (a 16-bit cache ignores them); K/V off by 25% already moves logprobs by 0.05 here."""
    fp8, llm = _run(scaled_llama, "fp8_e4m3")
    layers = llm.engine.pool.num_layers
    assert llm.engine.pool.k_scales == [0.25] * layers
    assert llm.engine.pool.v_scales == [4.0] * layers
    llm.close()
    auto, llm = _run(scaled_llama, "auto")
    assert llm.engine.pool.k_scales == [1.0] * layers
    llm.close()
    assert [o["token_ids"] for o in fp8] == [o["token_ids"] for o in auto]
    lp = [torch.tensor(o["prompt_logprobs"][1:]) for o in (*fp8, *auto)]
    diff = (torch.cat(lp[:3]) - torch.cat(lp[3:])).abs()
    assert diff.max() < 0.02 and diff.mean() < 0.005
