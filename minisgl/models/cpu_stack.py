"""A CPU decode step's decoder layers in one C call (csrc/cpu_stack.c).

At batch 1 a small model on the CPU spends as long in Python and torch's dispatch between
its kernels as in the kernels themselves (~10 calls per layer). Where every linear layer's
weights are packed for the C kernels (GGUF, layers/quantization.py's CpuKernelQuantMethod)
and the step only decodes, `CpuDecodeStack` hands the whole stack to C: the same kernels in
the same order, so the floats are the layer-by-layer path's except SiLU's rounding. Anything
else (prefill, float weights, TP, MoE, q/k norms, biases, MINISGL_CPU_STACK=0) runs the
layers one by one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from minisgl.attention.torch_backend import TorchBackend
from minisgl.env import CPU_STACK, CPU_TILE_ROWS
from minisgl.kernels import cpu
from minisgl.layers.activation import silu_and_mul
from minisgl.layers.quantization import CpuKernelQuantMethod, KernelWeights

if TYPE_CHECKING:
    from minisgl.attention.base import ForwardBatch
    from minisgl.models.decoder_layer import DecoderLayer

LinearSpec = tuple[int, int, tuple[tuple[int, int, int, int, int, int, int], ...]]


def _packed(layer: nn.Module) -> KernelWeights | None:
    quant = getattr(layer, "quant", None)
    if not isinstance(quant, CpuKernelQuantMethod) or getattr(layer, "bias", None) is not None:
        return None
    weights = quant.kernel_weights(layer)
    return weights if weights is not None and len(weights.segments) <= 8 else None


def _layer_weights(layer: DecoderLayer) -> list[KernelWeights] | None:
    """qkv, o, gate_up and down; None where the layer is not a plain attention + SiLU-gated
    MLP layer whose products all read packed weights."""
    attn, mlp = layer.self_attn, layer.mlp
    if layer.tp.size != 1 or attn.q_norm is not None:
        return None
    if getattr(mlp, "act", None) is not silu_and_mul:
        return None  # MoE, or another activation
    linears = (attn.qkv_proj, attn.o_proj, *map(mlp.get_submodule, ("gate_up_proj", "down_proj")))
    packed = [_packed(m) for m in linears]
    return None if any(p is None for p in packed) else [p for p in packed if p is not None]


class CpuDecodeStack:
    """The plan of one model's stack, built at its first decode step on the CPU."""

    def __init__(self) -> None:
        self.plan: object | None = None
        self.max_rows = 0
        self.usable: bool | None = None  # None: not yet looked at
        self.pool_ptr = 0  # the KV pool the plan points into

    def run(
        self, layers: list[DecoderLayer], x: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, residual) after every layer, or None where this step is not for C."""
        if self.usable is False or not CPU_STACK.get() or not cpu.fused_ok(x) or x.dim() != 2:
            return None
        backend = batch.attn_backend
        if not isinstance(backend, TorchBackend):
            return None
        rows = backend.cpu_decode_rows(batch.attn_metadata)
        if rows is None:
            return None
        if self.usable is None or self.pool_ptr != backend.pool.k(0).data_ptr():
            self.usable = self._build(layers, backend)
        if not self.usable or x.shape[0] > self.max_rows:
            return None
        kv_index, seq_lens = rows
        x = x.contiguous()
        pos, slots = batch.positions.to(torch.int64), batch.out_slots.to(torch.int64)
        x_out, res_out = torch.empty_like(x), torch.empty_like(x)
        cpu.module().stack_forward(
            self.plan,
            x.data_ptr(),
            0,
            x.shape[0],
            pos.data_ptr(),
            kv_index.data_ptr(),
            kv_index.stride(0),
            seq_lens.data_ptr(),
            slots.data_ptr(),
            x_out.data_ptr(),
            res_out.data_ptr(),
            int(CPU_TILE_ROWS.get()),
        )
        return x_out, res_out

    def _build(self, layers: list[DecoderLayer], backend: TorchBackend) -> bool:
        found = [_layer_weights(layer) for layer in layers]
        weights = [w for w in found if w is not None]
        if len(weights) != len(layers):
            return False
        first = layers[0]
        attn, norm, pool = first.self_attn, first.input_layernorm, backend.pool
        gate_up = weights[0][2]
        self.plan = cpu.module().stack_new(
            len(layers),
            norm.weight.shape[0],
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            gate_up.out_features // 2,
            norm.eps,
            attn.scale,
            attn.rotary.cos_table.data_ptr(),
            attn.rotary.sin_table.data_ptr(),
        )
        for i, (layer, packed) in enumerate(zip(layers, weights, strict=True)):
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            specs = [(w.out_features, w.in_features, w.segments) for w in packed]
            cpu.module().stack_set_layer(
                self.plan,
                i,
                *(n.weight.data_ptr() for n in norms),
                pool.k(i).data_ptr(),
                pool.v(i).data_ptr(),
                *specs,
            )
        self.max_rows = min(w.max_rows for packed in weights for w in packed)
        self.pool_ptr = pool.k(0).data_ptr()
        return True
