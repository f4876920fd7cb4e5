"""The attention layer: merged q/k/v, optional q/k norm, RoPE, backend attention, o_proj."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from minisgl.attention.base import QKNormRope
from minisgl.distributed import TPInfo
from minisgl.kernels import cpu
from minisgl.layers.linear import QKVParallelLinear, RowParallelLinear
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding
from minisgl.models.config import ModelConfig

if TYPE_CHECKING:
    from minisgl.attention.base import ForwardBatch


class SelfAttention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, tp: TPInfo
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_heads // tp.size
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.attention_bias,
            tp,
            cfg.quant,
        )
        self.num_kv_heads = self.qkv_proj.local_kv_heads
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, tp, cfg.quant
        )
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.scale = cfg.head_dim**-0.5

    def forward(self, x: torch.Tensor, batch: ForwardBatch, reduce: bool = True) -> torch.Tensor:
        """``reduce=False``: o_proj's partial sum over TP ranks (see RowParallelLinear)."""
        return self.forward_qkv(self.qkv_proj(x), batch, reduce)

    def forward_qkv(
        self, qkv: torch.Tensor, batch: ForwardBatch, reduce: bool = True
    ) -> torch.Tensor:
        """The layer from its q/k/v projection on (the decoder layer may compute that one
        fused with the norm before it)."""
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        backend = batch.attn_backend
        pool, layer = backend.pool, self.layer_id
        pool.wait_layer(layer)  # a prefix loaded back from a tier (HiCache)
        unscaled = pool.k_scales[layer] == 1.0 and pool.v_scales[layer] == 1.0
        if backend.fused_kv_store and unscaled:  # the fused store writes unscaled values
            norm_rope, md = self._norm_rope(batch), batch.attn_metadata
            out = backend.forward_norm_rope(
                q, k, v, norm_rope, layer, batch.out_slots, md, self.scale
            )
        else:
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
                q, k = self.rotary(batch.positions, q, k)
            elif cpu.fused_ok(qkv) and qkv.is_contiguous():  # q and k rotated inside qkv
                rope = (self.rotary.cos_table, self.rotary.sin_table)
                cpu.rope_(qkv, batch.positions, *rope, self.num_heads + self.num_kv_heads)
            else:
                q, k = self.rotary(batch.positions, q, k)
            out = backend.forward(
                q, k, v, self.layer_id, batch.out_slots, batch.attn_metadata, self.scale
            )
        return self.o_proj(out, reduce)

    def _norm_rope(self, batch: ForwardBatch) -> QKNormRope:
        """The arguments of q/k norm and RoPE, for a backend that applies them fused with
        the K/V store (bit-identical to the unfused path on the GPU) or with attention."""
        rope = (batch.positions, self.rotary.cos_table, self.rotary.sin_table)
        if self.q_norm is None or self.k_norm is None:
            return QKNormRope(*rope)
        return QKNormRope(*rope, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
