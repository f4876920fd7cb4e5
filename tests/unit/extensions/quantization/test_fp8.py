"""FP8 checkpoints (minisgl/extensions/quantization/fp8.py) on CPU: tiny random models
quantized by tests/fp8_checkpoints.py to each supported format (Hugging Face block-wise
``fp8``, compressed-tensors per channel and per tensor; dense and MoE; some layers kept
float) load with exactly the weights of their dequantized float twins, decode Hugging
Face's greedy tokens on the twin, shard at TP=2 as the twin does, and run TP=2 as TP=1;
``--load-format dummy`` builds random FP8 weights; unsupported variants fail at load with a
ValueError naming the tensor and the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams, env
from minisgl.distributed import TPInfo
from minisgl.extensions.quantization.fp8 import Fp8Method
from minisgl.layers.quantization import parse_quant_config
from minisgl.models.config import ModelConfig
from tests.fp8_checkpoints import write_fp8
from tests.helpers import TinyModels, hf_greedy

PROMPTS = [[5, 6, 7], list(range(40, 73)), [3] * 21]
N_NEW = 12
ROOT = Path(__file__).resolve().parents[4]
# name -> (tiny model, format, modules kept float, static input scales)
CASES: dict[str, tuple[str, str, tuple[str, ...], bool]] = {
    "llama_block": ("llama", "block", (), False),
    "qwen3_channel_keep": ("qwen3", "channel", ("model.layers.1.mlp.down_proj",), False),
    "moe_block_keep": ("qwen3_moe", "block", ("model.layers.0.self_attn.o_proj",), False),
    "moe_tensor": ("qwen3_moe", "tensor", (), False),
    "moe_channel_static": ("qwen3_moe", "channel", (), True),
}


@pytest.fixture(scope="module")
def ckpts(
    tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, Path]]:
    """name -> (FP8 checkpoint, dequantized float twin)."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for i, (name, (arch, kind, keep, static)) in enumerate(CASES.items()):
        src = tiny_models.build(arch, seed=7)
        q, r = root / f"{name}_q", root / f"{name}_ref"
        out[name] = write_fp8(src, q, r, kind, keep=keep, static=static, seed=i)
    return out


def _build(path: Path, tp: TPInfo = TPInfo()) -> torch.nn.Module:
    from minisgl.models.loader import iter_safetensors, load_weights
    from minisgl.models.registry import build_model

    cfg = ModelConfig.from_dir(path)
    with torch.device("cpu"):
        model = build_model(cfg, tp, cfg.max_position)
    load_weights(model, iter_safetensors(path, torch.device("cpu")))
    return model


def _assert_same_params(model: torch.nn.Module, twin: torch.nn.Module) -> None:
    ours, want = dict(model.named_parameters()), dict(twin.named_parameters())
    assert ours.keys() == want.keys()  # no load-time tensors left behind
    for name, p in ours.items():
        assert p.dtype == want[name].dtype and torch.equal(p, want[name]), name


@pytest.mark.parametrize("name", list(CASES))
def test_loads_as_its_twin_and_decodes_hf_greedy(
    ckpts: dict[str, tuple[Path, Path]], name: str
) -> None:
    qpath, ref_path = ckpts[name]
    ref_tokens, ref_lps = hf_greedy(ref_path, PROMPTS, N_NEW)
    llm = LLM(str(qpath), page_size=4)
    assert isinstance(llm.engine.model_config.quant, Fp8Method)
    # CPU dequantizes once at load: the weights equal the twin's, bit for bit.
    _assert_same_params(llm.engine.model, _build(ref_path))
    params = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=True)
    for res, toks, lps in zip(llm.generate(PROMPTS, params), ref_tokens, ref_lps, strict=True):
        ours = res["logprobs"]
        assert res["token_ids"] == toks and isinstance(ours, list)
        assert max(abs(a - b) for a, b in zip(ours, lps, strict=True)) < 1e-4


@pytest.mark.parametrize("name", list(CASES))
def test_tp_shards_equal_the_twins(ckpts: dict[str, tuple[Path, Path]], name: str) -> None:
    """Each rank's dequantized weights equal the same rank's shards of the float twin: the
    scales shard with their rows (merged q/k/v and gate/up, experts' intermediate slices)
    and along whole blocks of K (row-parallel layers, experts' down projections)."""
    qpath, ref_path = ckpts[name]
    for rank in (0, 1):
        tp = TPInfo(rank=rank, size=2)
        _assert_same_params(_build(qpath, tp), _build(ref_path, tp))


@pytest.mark.timeout(180)
def test_tp2_matches_tp1(ckpts: dict[str, tuple[Path, Path]]) -> None:
    """Two gloo ranks on a MoE model (a dense layer, a sparse one, one layer kept float)."""
    path = str(ckpts["moe_block_keep"][0])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [r["token_ids"] for r in LLM(path).generate(PROMPTS, params)]
    with env.override({env.DIST_TIMEOUT_S: 60}), LLM(path, tp_size=2) as tp2:
        assert [r["token_ids"] for r in tp2.generate(PROMPTS, params)] == want


def test_load_time_tensors_freed_as_layers_finish(
    ckpts: dict[str, tuple[Path, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The load-time tensors a layer drops once loaded are freed there and then, not at the
    end of loading: a 30B FP8 MoE's bf16-form experts beside their e4m3 copies overflowed
    an 80 GB GPU while load_weights still held every parameter by name."""
    import gc
    import weakref

    from minisgl.models import loader

    finish = loader.finish_loading
    survivors: list[str] = []

    def finish_and_check(model: torch.nn.Module) -> None:
        raw = [
            (n, weakref.ref(p))
            for n, p in model.named_parameters()
            if getattr(p, "raw_checkpoint", False)
        ]
        finish(model)
        kept = {id(p) for p in model.parameters()}
        survivors.extend(n for n, r in raw if (p := r()) is not None and id(p) not in kept)

    monkeypatch.setattr(loader, "finish_loading", finish_and_check)
    gc.disable()  # freed by reference counts, not by a later collection
    try:
        _build(ckpts["moe_block_keep"][0])
    finally:
        gc.enable()
    assert not survivors, survivors


@pytest.mark.parametrize(("arch", "kind"), [("qwen3", "block"), ("qwen3_moe", "tensor")])
def test_dummy_load_builds_fp8_weights(
    tiny_models: TinyModels, tmp_path: Path, arch: str, kind: str
) -> None:
    """--load-format dummy: the FP8 model is the float dummy model quantized (each weight
    within e4m3's rounding of it), and it decodes."""
    src = tiny_models[arch]
    q, _ = write_fp8(src, tmp_path / "q", tmp_path / "r", kind)
    fp8 = LLM(str(q), load_format="dummy")
    floats = dict(LLM(str(src), load_format="dummy").engine.model.named_parameters())
    for name, p in fp8.engine.model.named_parameters():
        err = (p - floats[name]).norm() / floats[name].norm()
        assert err < (0.05 if name.endswith(("_proj.weight", "w13", "w2")) else 1e-7), name
    out = fp8.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    tokens = out[0]["token_ids"]
    assert isinstance(tokens, list) and len(tokens) == 4


def test_benchmark_configs() -> None:
    configs = ROOT / "benchmark" / "configs"
    dense = ModelConfig.from_dir(configs / "Qwen3-8B-FP8")
    moe = ModelConfig.from_dir(configs / "Qwen3-30B-A3B-FP8")
    assert dense.quant == moe.quant == Fp8Method("fp8", "weight_scale_inv", (128, 128))
    assert moe.is_moe and not dense.is_moe
    for name in ("Qwen3-8B", "Qwen3-30B-A3B"):  # the float configs plus quantization_config
        fp8 = json.loads((configs / f"{name}-FP8" / "config.json").read_text())
        fp8.pop("quantization_config")
        assert fp8 == json.loads((configs / name / "config.json").read_text())


# ------------------------------------------------------------------ unsupported variants
CT = {"quant_method": "compressed-tensors", "format": "float-quantized"}


def _ct(weights: dict | None = None, acts: dict | None = None) -> dict:
    w = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True} | (weights or {})
    a = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True} | (acts or {})
    return CT | {"config_groups": {"group_0": {"weights": w, "input_activations": a}}}


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt='e5m2'"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size=\[128\]"),
        ({"quant_method": "fp8", "activation_scheme": "x"}, "activation_scheme='x'"),
        (CT | {"format": "pack-quantized"}, "format='pack-quantized'"),
        (_ct({"strategy": "group"}), "group_0.weights.strategy='group'"),
        (_ct({"num_bits": 4}), "group_0.weights.num_bits=4"),
        (_ct({"type": "int"}), "group_0.weights.type='int'"),
        (_ct({"symmetric": False}), "group_0.weights.symmetric=False"),
        (_ct(acts={"num_bits": 4}), "group_0.input_activations.num_bits=4"),
    ],
)
def test_unsupported_configs_name_the_field(config: dict, named: str) -> None:
    with pytest.raises(ValueError, match=f"quantization_config.*{named}"):
        parse_quant_config(config)


def _edited(src: Path, dst: Path, drop: str = "", retype: str = "", **config: object) -> Path:
    """A copy of checkpoint ``src`` without tensor ``drop``, with tensor ``retype`` in
    float8_e5m2, and ``config`` merged into its quantization_config."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(src / "model.safetensors"))
    weights.pop(drop, None)
    if retype:
        weights[retype] = weights[retype].float().to(torch.float8_e5m2)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"].update(config)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    ("case", "edit", "named"),
    [
        ("llama_block", {"drop": "model.layers.1.self_attn.k_proj.weight_scale_inv"},
         r"tensor model\.layers\.1\.self_attn\.k_proj\.weight_scale_inv is missing: "
         r"quantization_config\.quant_method='fp8'"),
        ("moe_block_keep", {"drop": "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"},
         r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight_scale_inv is missing"),
        ("moe_tensor", {"drop": "model.layers.1.mlp.experts.5.down_proj.weight_scale"},
         r"model\.layers\.1\.mlp\.experts\.5\.down_proj\.weight_scale is missing"),
        ("llama_block", {"activation_scheme": "static"},
         r"model\.layers\.0\.self_attn\.q_proj\.input_scale is missing: "
         r"quantization_config\.activation_scheme='static'"),
        ("llama_block", {"retype": "model.layers.1.mlp.up_proj.weight"},
         r"model\.layers\.1\.mlp\.up_proj\.weight: torch\.float8_e5m2 weights .*fmt 'e4m3'"),
        ("llama_block", {"weight_block_size": [48, 16]},
         r"layers\.0\.mlp\.down_proj\.weight: quantization_config\.weight_block_size="
         r"\[48, 16\] does not split its shape \(64, 128\)"),
    ],
)  # fmt: skip
def test_bad_checkpoints_name_the_tensor_and_field(
    ckpts: dict[str, tuple[Path, Path]], tmp_path: Path, case: str, edit: dict, named: str
) -> None:
    path = _edited(ckpts[case][0], tmp_path / "bad", **edit)
    with pytest.raises(ValueError, match=named):
        _build(path)


def test_static_compressed_tensors_without_input_scales(
    ckpts: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    src = ckpts["moe_channel_static"][0]
    path = _edited(src, tmp_path / "bad", drop="model.layers.1.mlp.experts.2.gate_proj.input_scale")
    named = r"experts\.2\.gate_proj\.input_scale is missing: .*input_activations\.dynamic=false"
    with pytest.raises(ValueError, match=named):
        _build(path)


def test_tp_shards_split_k_along_whole_blocks(tiny_models: TinyModels, tmp_path: Path) -> None:
    """Experts' down projections (32 inputs) in blocks of 32 inputs: whole at TP=1; at TP=2
    each rank would hold half a block."""
    q, _ = write_fp8(tiny_models.build("qwen3_moe", seed=7), tmp_path / "q", tmp_path / "r",
                     "block", block=(32, 32))  # fmt: skip
    _build(q)
    named = r"experts\.\d+\.down_proj\.weight: .*\(16 inputs per tensor-parallel rank\)"
    with pytest.raises(ValueError, match=named):
        _build(q, TPInfo(rank=1, size=2))


def test_float8_tensor_for_a_float_layer(
    ckpts: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    path = _edited(ckpts["moe_tensor"][0], tmp_path / "bad")
    weights = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.gate.weight"  # the router: float in every supported format
    weights[name] = weights[name].to(torch.float8_e4m3fn)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"mlp\.gate\.weight: a torch\.float8_e4m3fn tensor"):
        _build(path)
