"""One decoder layer (attention, then a gated MLP or MoE), as every model of decoder.py
stacks it; its own module so that the CPU decode stack (cpu_stack.py) can read its parts
without importing the model."""

from __future__ import annotations

import torch
from torch import nn

from minisgl.attention.base import ForwardBatch
from minisgl.distributed import TPInfo
from minisgl.layers.activation import ACTIVATIONS
from minisgl.layers.attention import SelfAttention
from minisgl.layers.linear import ColumnParallelLinear, RowParallelLinear
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding
from minisgl.models.config import ModelConfig


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
        # SiLU-and-mul inside down_proj's batch-1 GEMV (set_silu_fusion; same bits).
        self.silu_in_down = False
        self.is_silu = cfg.hidden_act == "silu"

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """``reduce=False``: down_proj's partial sum over TP ranks (see RowParallelLinear)."""
        gate_up = self.gate_up_proj(x)
        if (
            self.silu_in_down
            and (y := self.down_proj.forward_silu_mul(gate_up, reduce)) is not None
        ):
            return y
        return self.down_proj(self.act(gate_up), reduce)


def set_silu_fusion(model: nn.Module, enabled: bool) -> None:
    """Turn the SiLU-and-mul + down-projection fusion of every SiLU gated MLP on or off (the
    engine's ``disable_fused_silu_down``; it applies where down_proj runs the batch-1 GEMV)."""
    for module in model.modules():
        if isinstance(module, GatedMLP):
            module.silu_in_down = enabled and module.is_silu


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
