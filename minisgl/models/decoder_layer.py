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
        # SiLU-and-mul inside down_proj's batch-1 GEMV (set_batch1_fusions; same bits); a
        # quantized down_proj may compute it on the way in at any row count.
        self.silu_in_down = False
        self.is_silu = cfg.hidden_act == "silu"

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """``reduce=False``: down_proj's partial sum over TP ranks (see RowParallelLinear)."""
        return self.forward_gate_up(self.gate_up_proj(x), reduce)

    def forward_gate_up(self, gate_up: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """The MLP from its gate/up projection on (which the decoder layer may compute fused
        with the norm before it)."""
        if self.is_silu:
            y = self.down_proj.forward_silu_mul(gate_up, reduce, self.silu_in_down)
            if y is not None:
                return y
        return self.down_proj(self.act(gate_up), reduce)


def set_batch1_fusions(model: nn.Module, silu_down: bool, norm_gemv: bool) -> None:
    """The engine's batch-1 GEMV fusions (where a layer runs the GEMV): SiLU-and-mul inside
    every SiLU gated MLP's down projection (off with ``disable_fused_silu_down``: same bits),
    and each decoder layer's pre-norms inside the q/k/v and gate/up projections (off with
    ``disable_fused_norm_gemv``: 1 / rms summed in another order)."""
    for module in model.modules():
        if isinstance(module, GatedMLP):
            module.silu_in_down = silu_down and module.is_silu
        elif isinstance(module, DecoderLayer):
            module.norm_in_gemv = norm_gemv


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
        self.norm_in_gemv = False  # set_batch1_fusions

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x and the returned output are partial sums over the TP ranks: every all-reduce
        happens inside the norm that follows it (fused with it on GPUs with peer memory)."""
        norm = self.input_layernorm
        qkv = self._normed_product(self.self_attn.qkv_proj, norm, x, residual)
        if qkv is not None:
            h = self.self_attn.forward_qkv(qkv[0], batch, reduce=False)
            residual = qkv[1]
        else:
            h, residual = norm.forward_with_residual(x, residual, self.tp)
            h = self.self_attn(h, batch, reduce=False)
        norm = self.post_attention_layernorm
        mlp = self.mlp
        if isinstance(mlp, GatedMLP):
            gate_up = self._normed_product(mlp.gate_up_proj, norm, h, residual)
            if gate_up is not None:
                return mlp.forward_gate_up(gate_up[0], reduce=False), gate_up[1]
        h, residual = norm.forward_with_residual(h, residual, self.tp)
        return mlp(h, reduce=False), residual

    def _normed_product(
        self,
        proj: ColumnParallelLinear,
        norm: RMSNorm,
        x: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(proj(norm(x + residual)), x + residual) with the norm inside the kernel that
        makes or reads proj's input (batch-1 GEMV, quantized activations), or None."""
        return proj.forward_add_rms_norm(x, residual, norm.weight, norm.eps, self.norm_in_gemv)
