"""One decoder-only transformer that Llama, Mistral, Qwen2 and Qwen3 are all built from.

The models differ only in flags of ModelConfig (qkv bias, q/k norm, tied embeddings,
RoPE scaling); the forward pass takes the batch explicitly.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.attention.base import ForwardBatch
from minisgl.distributed import TPInfo
from minisgl.layers.activation import ACTIVATIONS
from minisgl.layers.attention import SelfAttention
from minisgl.layers.embedding import ParallelLMHead
from minisgl.layers.linear import ColumnParallelLinear, RowParallelLinear
from minisgl.layers.norm import RMSNorm
from minisgl.layers.quantization import EmbeddingQuantMethod
from minisgl.layers.rotary import RotaryEmbedding
from minisgl.models.config import ModelConfig
from minisgl.models.cpu_stack import CpuDecodeStack


def _embed_quant(cfg: ModelConfig) -> EmbeddingQuantMethod | None:
    """The checkpoint's method where it also quantizes embeddings (GGUF), else None."""
    return cfg.quant if isinstance(cfg.quant, EmbeddingQuantMethod) else None


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate: int, tp: TPInfo) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size, [intermediate, intermediate], cfg.mlp_bias, tp, cfg.quant
        )
        self.down_proj = RowParallelLinear(
            intermediate, cfg.hidden_size, cfg.mlp_bias, tp, cfg.quant
        )
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """``reduce=False``: down_proj's partial sum over TP ranks (see RowParallelLinear)."""
        return self.down_proj(self.act(self.gate_up_proj(x)), reduce)


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, tp: TPInfo
    ) -> None:
        super().__init__()
        self.self_attn = SelfAttention(cfg, layer_id, rotary, tp)
        self.mlp: nn.Module
        if cfg.layer_is_moe(layer_id):
            from minisgl.layers.moe import SparseMoE

            self.mlp = SparseMoE(cfg, tp)
        else:
            self.mlp = GatedMLP(cfg, cfg.intermediate_size, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tp = tp

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x and the returned output are partial sums over the TP ranks: every all-reduce
        happens inside the norm that follows it (fused with it on GPUs with peer memory)."""
        h, residual = self.input_layernorm.forward_with_residual(x, residual, self.tp)
        h = self.self_attn(h, batch, reduce=False)
        h, residual = self.post_attention_layernorm.forward_with_residual(h, residual, self.tp)
        return self.mlp(h, reduce=False), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPInfo, max_position: int) -> None:
        super().__init__()
        # A ParallelLMHead, so that tied models use this one module for the output too.
        self.embed_tokens = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, _embed_quant(cfg))
        # One RoPE table shared by every layer (buffers are not parameters, so not loaded).
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, max_position)
        layers = [DecoderLayer(cfg, i, rotary, tp) for i in range(cfg.num_layers)]
        self.local_kv_heads = layers[0].self_attn.num_kv_heads
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tp = tp
        self.cpu_stack = CpuDecodeStack()  # every layer in one C call, where it can

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids, reduce=False)
        layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        residual: torch.Tensor | None = None
        stacked = self.cpu_stack.run(layers, x, batch) if x.device.type == "cpu" else None
        if stacked is not None:
            x, residual = stacked
        else:
            for layer in layers:
                x, residual = layer(x, residual, batch)
        x, _ = self.norm.forward_with_residual(x, residual, self.tp)
        return x


class CausalLM(nn.Module):
    """Shared by every supported architecture; see models/registry.py."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo, max_position: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, tp, max_position)
        if cfg.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, _embed_quant(cfg))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [R, vocab] in the model's dtype for the tokens in ``batch.logits_index``.

        Not upcast here: a float32 copy of [R, vocab] is a full extra pass per step, and the
        fused sampler reads the model's dtype itself. Consumers that need float32 convert
        (bf16/fp16 -> fp32 is exact, so their results are the same)."""
        return self.logits(self.model(batch)[batch.logits_index])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [R, vocab] (model dtype) of final hidden states [R, hidden]."""
        return self.lm_head.compute_logits(hidden)

    @property
    def local_kv_heads(self) -> int:
        """KV heads of this rank's attention layers (what its KV pool holds per token)."""
        return self.model.local_kv_heads
