"""Repetition, frequency and presence penalties' state: what each request slot has seen."""

from __future__ import annotations

import torch
from torch import Tensor


def h2d(t: Tensor, device: torch.device | str) -> Tensor:
    # From pageable host memory a copy syncs the CUDA stream; from pinned memory it need not.
    if t.device.type == "cpu" and torch.device(device).type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


class PenaltyState:
    """Per-slot output-token counts and prompt-token masks, [max_slots, V], allocated by the
    first `reset_slot` (`add_tokens` is a no-op before). Stale slots of requests without
    penalties are harmless: their penalties are neutral."""

    def __init__(self, max_slots: int, vocab_size: int, device: torch.device | str) -> None:
        self.max_slots = max_slots
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.output_counts: Tensor | None = None  # [max_slots, V] int32
        self.prompt_mask: Tensor | None = None  # [max_slots, V] bool

    def reset_slot(self, slot: int, prompt_ids: Tensor, output_ids: Tensor | None = None) -> None:
        """Start a request in `slot`; `output_ids` restores counts after a recompute."""
        shape, dev = (self.max_slots, self.vocab_size), self.device
        if self.output_counts is None:
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=dev)
        if self.prompt_mask is None:
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=dev)
        counts, prompt = self.output_counts[slot].zero_(), self.prompt_mask[slot].zero_()
        prompt.index_fill_(0, h2d(prompt_ids.long(), dev), True)
        if output_ids is not None:
            ids = h2d(output_ids.long(), dev)
            counts.scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def add_tokens(self, slots: Tensor, tokens: Tensor) -> None:
        """counts[slots[i], tokens[i]] += 1, on device; repeated (slot, token) pairs add up."""
        if self.output_counts is None:
            return
        flat = slots.to(torch.int64) * self.vocab_size + tokens.to(torch.int64)
        self.output_counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
