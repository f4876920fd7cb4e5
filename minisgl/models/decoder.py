"""One decoder-only transformer that Llama, Mistral, Qwen2 and Qwen3 are all built from.

The models differ only in flags of ModelConfig (qkv bias, q/k norm, tied embeddings,
RoPE scaling); the forward pass takes the batch explicitly.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.attention.base import ForwardBatch
from minisgl.distributed import TPInfo
from minisgl.layers.embedding import ParallelLMHead
from minisgl.layers.norm import RMSNorm
from minisgl.layers.quantization import EmbeddingQuantMethod
from minisgl.layers.rotary import RotaryEmbedding
from minisgl.models.config import ModelConfig
from minisgl.models.cpu_stack import CpuDecodeStack
from minisgl.models.decoder_layer import DecoderLayer


def _embed_quant(cfg: ModelConfig) -> EmbeddingQuantMethod | None:
    """The checkpoint's method where it also quantizes embeddings (GGUF), else None."""
    return cfg.quant if isinstance(cfg.quant, EmbeddingQuantMethod) else None


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
