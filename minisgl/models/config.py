"""Model configuration: one frozen dataclass read from a Hugging Face config.json (or a GGUF)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

from minisgl.layers.quantization import ExpertQuantMethod, QuantMethod, parse_quant_config

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    # "default", "linear", "llama3" or "yarn"; the numeric keys of HF's rope_scaling dict.
    scaling_type: str = "default"
    scaling: tuple[tuple[str, float], ...] = ()
    max_position: int = 2048

    @overload
    def get(self, key: str) -> float | None: ...
    @overload
    def get(self, key: str, default: float) -> float: ...
    def get(self, key: str, default: float | None = None) -> float | None:
        return dict(self.scaling).get(key, default)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qkv bias (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # Llama's attention_bias also biases o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    hidden_act: str = "silu"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Mixture of experts (Qwen3-MoE); num_experts == 0 means dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    # The checkpoint's quantization method (layers/quantization.py); None: float weights.
    quant: QuantMethod | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_moe(self, layer_id: int) -> bool:
        return (
            self.is_moe
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        archs = d.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model architecture {arch!r}; supported: "
                + ", ".join(SUPPORTED_ARCHITECTURES)
            )
        text = d.get("text_config") or d
        num_heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        head_dim = text.get("head_dim") or hidden // num_heads
        eos = text.get("eos_token_id", d.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        is_qwen2 = arch == "Qwen2ForCausalLM"
        is_qwen3 = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        attn_bias = bool(text.get("attention_bias", False))
        max_pos = int(text.get("max_position_embeddings", 2048))
        quant = parse_quant_config(d.get("quantization_config") or text.get("quantization_config"))
        num_experts = int(text.get("num_experts") or text.get("num_local_experts") or 0)
        if quant is not None and num_experts and not isinstance(quant, ExpertQuantMethod):
            raise ValueError(
                f"quantization_config.quant_method={quant.name!r} is not supported for "
                "mixture-of-experts models"
            )
        return cls(
            architecture=arch,
            model_type=str(text.get("model_type", "")),
            vocab_size=int(text["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(text.get("intermediate_size", 4 * hidden)),
            num_layers=int(text["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(text.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            max_position=max_pos,
            rope=_rope_config(text, max_pos),
            tie_word_embeddings=bool(
                d.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            ),
            attention_bias=is_qwen2 or attn_bias,
            o_bias=attn_bias and not is_qwen2 and not is_qwen3,
            mlp_bias=bool(text.get("mlp_bias", False)),
            qk_norm=is_qwen3,
            hidden_act=str(text.get("hidden_act", "silu")),
            eos_token_ids=eos_ids,
            bos_token_id=text.get("bos_token_id"),
            # transformers 5 saves the expert count as "num_local_experts" only.
            num_experts=num_experts,
            num_experts_per_tok=int(text.get("num_experts_per_tok", 0) or 0),
            moe_intermediate_size=int(text.get("moe_intermediate_size", 0) or 0),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            decoder_sparse_step=int(text.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(text.get("mlp_only_layers") or ()),
            quant=quant,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        with open(Path(path) / "config.json") as f:
            return cls.from_dict(json.load(f))


def _rope_config(d: dict[str, Any], max_pos: int) -> RopeConfig:
    # transformers 4.x: rope_theta + rope_scaling; 5.x: rope_parameters holding both.
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    if not scaling and params.get("rope_type", "default") != "default":
        scaling = params
    theta = float(d.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = str(scaling.get("rope_type") or scaling.get("type") or "default")
    if kind not in ("default", "linear", "llama3", "yarn"):
        raise ValueError(f"unsupported rope scaling type {kind!r}")
    skip = ("rope_type", "type", "rope_theta")
    extra = tuple(
        sorted(
            (k, float(v))
            for k, v in scaling.items()
            if k not in skip and isinstance(v, (int, float))
        )
    )
    return RopeConfig(theta=theta, scaling_type=kind, scaling=extra, max_position=max_pos)
