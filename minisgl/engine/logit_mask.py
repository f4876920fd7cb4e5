"""Constrained decoding's logit mask (the bitmask comes from a ConstraintBackend,
minisgl/scheduler/plugins.py)."""

from __future__ import annotations

import torch


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` [B, V] with every token whose bit is 0 in ``bitmask`` [B, ceil(V / 32)]
    (int32, on logits' device) set to -inf. Vectorised: no loop over rows or tokens."""
    rows, vocab = logits.shape
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().view(rows, -1)
    if allowed.shape[1] < vocab:  # never the case with the model's own vocabulary size
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return logits.masked_fill(~allowed[:, :vocab], float("-inf"))
