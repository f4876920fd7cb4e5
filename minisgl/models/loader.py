"""Weight loading: safetensors directories, GGUF files, or random "dummy" weights.

Checkpoint tensors are streamed one at a time to the device and copied into the (possibly
merged, possibly sharded) parameter that owns them, so host memory never holds the model
twice.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from minisgl.layers.embedding import VocabParallelEmbedding
from minisgl.layers.linear import ShardedLinear
from minisgl.layers.moe import ALL_EXPERTS, SparseMoE
from minisgl.layers.quantization import DummyQuantizer, MissingTensor, parse_quant_config

# checkpoint sub-name -> (our parameter sub-name, shard index inside the merged parameter)
_MERGED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_MERGED_RE = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.")
_SKIP_RE = re.compile(r"rotary_emb\.inv_freq|\.attn\.bias$|masked_bias")
# MoE experts (layers/moe.py packs them): one tensor per expert and projection as in
# Qwen3-MoE hub checkpoints and transformers' default save, or transformers 5's packed
# [E, 2I, H] gate_up_proj / [E, H, I] down_proj (save_pretrained(save_original_format=False)).
# A quantized expert's other tensors (e.g. weight_scale_inv) go to w13_<name> / w2_<name>.
_EXPERT_RE = re.compile(
    r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\."
    r"(weight|weight_scale_inv|weight_scale|input_scale)$"
)
_PACKED_EXPERTS_RE = re.compile(r"\.experts\.(gate_up_proj|down_proj)(\.weight)?$")


def iter_safetensors(model_dir: Path, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in model directory {str(model_dir)!r}")
    dev = "cpu" if device.type == "cpu" else str(device)
    for name in files:
        with safe_open(str(model_dir / name), framework="pt", device=dev) as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield key, f.get_tensor(key)


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    _load_checkpoint(model, weights)
    # Only now: while a name -> parameter map is alive, the load-time tensors that
    # finish_loading drops stay allocated beside what replaces them (a 30B FP8 MoE's
    # bf16-form experts and their e4m3 copies did not fit 80 GB together).
    finish_loading(model)


def _load_checkpoint(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters())
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    loaded: set[str] = set()
    for name, tensor in weights:
        if _SKIP_RE.search(name):
            continue
        if name.startswith("lm_head.") and tied:
            continue  # tied to the embedding, which is loaded under its own name
        target, shard = _map_name(name, params)
        if target is None:
            continue
        _load_tensor(name, tensor, params[target], shard)
        loaded.add(f"{target}#{shard}")
        del tensor
    missing = [
        n
        for n, p in params.items()
        if not getattr(p, "optional", False) and not any(k.startswith(n + "#") for k in loaded)
    ]
    if tied:
        missing = [n for n in missing if n != "lm_head.weight"]
    if missing:
        raise ValueError(
            f"checkpoint is missing weights: {missing[:8]}{' …' if len(missing) > 8 else ''}"
        )


def _load_tensor(name: str, tensor: torch.Tensor, param: nn.Parameter, shard: int) -> None:
    loader = getattr(param, "weight_loader", None)
    # Quantized tensors (layers/quantization.py) keep their dtype: their loader converts.
    raw = getattr(param, "raw_checkpoint", False)
    if not raw and tensor.is_floating_point() and tensor.dtype.itemsize == 1:
        raise ValueError(f"{name}: a {tensor.dtype} tensor where this engine loads float ones")
    tensor = tensor.to(device=param.device, dtype=None if raw else param.dtype)
    if loader is None:
        if param.shape != tensor.shape:
            raise ValueError(
                f"shape mismatch for {name}: {tuple(tensor.shape)} vs {tuple(param.shape)}"
            )
        param.data.copy_(tensor)
        return
    try:
        loader(param, tensor, shard)
    except ValueError as e:  # a quantized tensor this engine does not run: name it
        raise ValueError(f"{name}: {e}") from None


def finish_loading(model: nn.Module) -> None:
    """Layers of a quantized checkpoint convert their weights once loaded (e.g. int4:
    dequantize on CPU, repack for the kernel on CUDA), in the dtype of the model's float
    weights."""
    floats = [
        p.dtype
        for p in model.parameters()
        if p.is_floating_point() and not getattr(p, "raw_checkpoint", False)
    ]
    dtype = floats[0] if floats else torch.get_default_dtype()
    hooked = False
    for name, module in model.named_modules():
        if isinstance(module, (ShardedLinear, SparseMoE, VocabParallelEmbedding)) and module.quant:
            try:
                module.finish_loading(dtype)
            except MissingTensor as e:
                tensor = f"{_checkpoint_name(name, e.param, e.shard)}.{e.tensor}"
                raise ValueError(f"checkpoint tensor {tensor} is missing: {e}") from None
            hooked = True
    if hooked and torch.cuda.is_available():
        torch.cuda.empty_cache()  # the unpacked load-time tensors, before the KV pool sizing


def _map_name(name: str, params: dict[str, nn.Parameter]) -> tuple[str | None, int]:
    expert = _map_expert(name)
    if expert is not None:
        return (expert[0] if expert[0] in params else None), expert[1]
    m = _MERGED_RE.search(name)
    if m:
        ours, shard = _MERGED[m.group(1)]
        name = name.replace(f".{m.group(1)}.", f".{ours}.")
        return (name if name in params else None), shard
    if name in params:
        return name, 0
    return None, 0


def _map_expert(name: str) -> tuple[str, int] | None:
    m = _EXPERT_RE.search(name)
    if m:
        e, proj, tensor = int(m.group(1)), m.group(2), m.group(3)
        ours = "w2" if proj == "down_proj" else "w13"
        target = f"{name[: m.start()]}.{ours}" + ("" if tensor == "weight" else f"_{tensor}")
        return target, e if proj == "down_proj" else 2 * e + (proj == "up_proj")
    m = _PACKED_EXPERTS_RE.search(name)
    if m:
        return f"{name[: m.start()]}.{'w13' if m.group(1) == 'gate_up_proj' else 'w2'}", ALL_EXPERTS
    return None


def _checkpoint_name(module: str, param: str, shard: int) -> str:
    """The checkpoint's name of shard ``shard`` of ``module``'s ``param`` (_map_name's
    inverse), e.g. model.layers.0.self_attn.k_proj or model.layers.1.mlp.experts.3.up_proj."""
    if param == "w2":
        return f"{module}.experts.{shard}.down_proj"
    if param == "w13":
        return f"{module}.experts.{shard // 2}.{('gate_proj', 'up_proj')[shard % 2]}"
    base, _, ours = module.rpartition(".")
    names = [k for k, v in _MERGED.items() if v == (ours, shard)]
    return f"{base}.{names[0]}" if names else module


def iter_dummy_weights(
    hf_config: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """A random checkpoint for benchmarks: every tensor the Hugging Face model of
    ``hf_config`` has, at its full (unsharded) shape: norms 1, biases 0, the rest
    normal(0, 0.02) (finite logits at any depth), each drawn from a seed of its own name.
    Loaded through load_weights, every tensor-parallel rank takes its shard of one and the
    same model, so TP=2 runs the TP=1 model. A quantized config whose method writes its own
    form (layers/quantization.py's DummyQuantizer: FP8) gets its linear weights quantized,
    experts one tensor per expert as hub checkpoints store them."""
    import zlib

    import transformers

    fields = dict(hf_config)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    quant = parse_quant_config(hf_config.get("quantization_config"))
    with torch.device("meta"):  # names and shapes only: no memory
        hf_model = transformers.AutoModelForCausalLM.from_config(config)
    for name, p in hf_model.named_parameters():
        if name.endswith("norm.weight"):
            t = torch.ones(p.shape, device=device, dtype=dtype)
        elif name.endswith(".bias"):
            t = torch.zeros(p.shape, device=device, dtype=dtype)
        else:
            gen = torch.Generator(device=device).manual_seed(seed + zlib.crc32(name.encode()))
            t = torch.empty(p.shape, device=device, dtype=dtype).normal_(0.0, 0.02, generator=gen)
        if isinstance(quant, DummyQuantizer) and _PROJ_RE.search(name):
            for one, w in _per_expert(name, t):
                yield from quant.quantize(one, w)
        else:
            yield name, t


_PROJ_RE = re.compile(r"_proj(\.weight)?$")  # linear weights: attention, MLP, experts


def _per_expert(name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Packed experts (transformers 5) -> one tensor per expert and projection."""
    m = _PACKED_EXPERTS_RE.search(name)
    if m is None:
        yield name, t
        return
    base = name[: m.start()]
    for e in range(t.shape[0]):
        if m.group(1) == "down_proj":
            yield f"{base}.experts.{e}.down_proj.weight", t[e]
            continue
        gate, up = t[e].chunk(2, dim=0)
        yield f"{base}.experts.{e}.gate_proj.weight", gate
        yield f"{base}.experts.{e}.up_proj.weight", up
