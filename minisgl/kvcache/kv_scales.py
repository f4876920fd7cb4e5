"""Per-tensor K/V scales of an fp8 KV cache, read from a checkpoint where it has them.

A cache slot holds ``value / scale`` in fp8 (kv_dtype.py); the attention kernels multiply it
back (folded into the softmax scale for K and into the output for V: kernels/fp8_kv.py).
Without scales in the checkpoint every scale is 1.0, as before. The names are the ones vLLM
reads (its ``maybe_remap_kv_scale_name``): a checkpoint with a ``kv_cache_scheme``
(compressed-tensors, llm-compressor) stores ``model.layers.N.self_attn.k_scale`` and
``v_scale``; older AutoFP8 ones ``self_attn.k_proj.output_scale`` / ``v_proj.output_scale``;
some a single ``self_attn.kv_scale`` for both; vLLM's own dumps ``self_attn.attn.k_scale``.
A scale stored per head is reduced to its maximum (one scale per tensor here).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

_NAME_RE = re.compile(
    r"layers\.(\d+)\.self_attn\.(?:attn\.)?"
    r"(k_scale|v_scale|kv_scale|k_proj\.output_scale|v_proj\.output_scale)$"
)
_WHICH = {
    "k_scale": "k",
    "v_scale": "v",
    "kv_scale": "kv",
    "k_proj.output_scale": "k",
    "v_proj.output_scale": "v",
}


def kv_scale_name(name: str) -> tuple[int, str] | None:
    """(layer, "k" / "v" / "kv") of a checkpoint tensor that is a KV-cache scale, else None."""
    m = _NAME_RE.search(name)
    return (int(m.group(1)), _WHICH[m.group(2)]) if m else None


class KVScales:
    """Collects the KV-cache scales a checkpoint holds while its weights stream past."""

    def __init__(self) -> None:
        self.k: dict[int, float] = {}
        self.v: dict[int, float] = {}

    def take(
        self, weights: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights`` without their KV-cache scales, which are kept here."""
        for name, tensor in weights:
            found = kv_scale_name(name)
            if found is None:
                yield name, tensor
                continue
            layer, which = found
            value = float(tensor.float().abs().max())  # one host read per layer, at load
            if not value > 0 or value == float("inf"):
                raise ValueError(f"{name}: a KV-cache scale must be positive and finite")
            if "k" in which:
                self.k[layer] = value
            if "v" in which:
                self.v[layer] = value

    def apply(self, k_scales: list[float], v_scales: list[float]) -> None:
        """Write the scales found into the pool's per-layer lists (others stay 1.0)."""
        for layer, value in self.k.items():
            if layer < len(k_scales):
                k_scales[layer] = value
        for layer, value in self.v.items():
            if layer < len(v_scales):
                v_scales[layer] = value

    def __bool__(self) -> bool:
        return bool(self.k or self.v)
