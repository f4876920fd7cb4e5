"""Rotary position embedding with default, linear, llama3 and yarn frequency schedules.

cos/sin are precomputed for every position once; applying them is a gather plus the
rotate-half form that Hugging Face checkpoints (and our GGUF loader) use.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from minisgl.models.config import RopeConfig


def _inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Returns (inverse frequencies [dim/2], attention scaling factor applied to cos/sin)."""
    base = rope.theta
    # float32 throughout, in Hugging Face's order of operations, so greedy outputs match it.
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = rope.scaling_type
    if kind == "default":
        return inv, 1.0
    factor = rope.get("factor", 1.0)
    if kind == "linear":
        return inv / factor, 1.0
    if kind == "llama3":
        low = rope.get("low_freq_factor", 1.0)
        high = rope.get("high_freq_factor", 4.0)
        old_ctx = rope.get("original_max_position_embeddings", 8192.0)
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(mid, smoothed, scaled), 1.0
    assert kind == "yarn", kind
    return _yarn(rope, dim, inv, factor)


def _yarn(
    rope: RopeConfig, dim: int, inv: torch.Tensor, factor: float
) -> tuple[torch.Tensor, float]:
    base = rope.theta
    orig = rope.get("original_max_position_embeddings") or rope.max_position
    beta_fast = float(rope.get("beta_fast") or 32)
    beta_slow = float(rope.get("beta_slow") or 1)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 0.1 * m * math.log(scale) + 1.0 if scale > 1 else 1.0

    attn = rope.get("attention_factor")
    if attn is None:
        ms, ms_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attn = mscale(factor, ms) / mscale(factor, ms_all) if ms and ms_all else mscale(factor)

    def correction_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low = correction_dim(beta_fast)
    high = correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv_interp = 1.0 / (factor * pos_freqs)
    inv_out = inv_interp * (1 - extrapolation_factor) + inv * extrapolation_factor
    return inv_out, float(attn)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rope: RopeConfig, max_position: int) -> None:
        super().__init__()
        inv, scale = _inv_freq(rope, head_dim)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    # Typed views of the buffers (nn.Module's __getattr__ is typed Tensor | Module).
    @property
    def cos_table(self) -> torch.Tensor:
        return self.get_buffer("cos")

    @property
    def sin_table(self) -> torch.Tensor:
        return self.get_buffer("sin")

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]; returns rotated copies in the input dtype."""
        if q.is_cuda:
            # Imported here so CPU-only installs never need triton.
            from minisgl.kernels.rope import apply_rope

            return apply_rope(positions, q, k, self.cos_table, self.sin_table)
        cos = self.cos_table[positions].unsqueeze(1)
        sin = self.sin_table[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos.to(x.dtype) + rotated * sin.to(x.dtype)).to(x.dtype)
