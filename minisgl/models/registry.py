"""Architecture name -> model class. All dense architectures share CausalLM."""

from __future__ import annotations

from minisgl.distributed import TPInfo
from minisgl.models.config import ModelConfig
from minisgl.models.decoder import CausalLM

# Llama and Mistral are the same network; Qwen2 adds qkv bias and Qwen3 q/k RMSNorm,
# both read from the config. Qwen3-MoE swaps the MLP for SparseMoE in sparse layers.
MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": CausalLM,
    "MistralForCausalLM": CausalLM,
    "Qwen2ForCausalLM": CausalLM,
    "Qwen3ForCausalLM": CausalLM,
    "Qwen3MoeForCausalLM": CausalLM,
}


def build_model(cfg: ModelConfig, tp: TPInfo, max_position: int) -> CausalLM:
    try:
        cls = MODEL_REGISTRY[cfg.architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {cfg.architecture!r}; supported: "
            + ", ".join(MODEL_REGISTRY)
        ) from None
    return cls(cfg, tp, max_position)
