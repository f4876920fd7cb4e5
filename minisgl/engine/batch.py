"""The forward batch: everything one model forward needs, passed explicitly to every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.attention.base import AttentionBackend


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] token ids of every new token, rows back to back
    positions: torch.Tensor  # [T] absolute positions
    out_slots: torch.Tensor  # [T] KV slot where each new token's K/V goes
    attn_backend: AttentionBackend
    attn_metadata: object
    logits_index: torch.Tensor  # [R] flat indices of the tokens whose next token is sampled
