"""The radix tree's node, and helpers the radix caches share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from minisgl.kvcache.allocator import PageAllocator

# The first page of a node's key: the bare token for page_size 1, else a tuple.
PageKey = int | tuple[int, ...]


@dataclass(eq=False)
class RadixNode:
    key: list[int]
    # int64 CPU token slots, len(value) == len(key); empty where a tier alone holds the KV
    value: torch.Tensor
    parent: RadixNode | None  # None for the root and for evicted (detached) nodes
    node_id: int  # unique; breaks timestamp ties in the eviction heap
    children: dict[PageKey, RadixNode] = field(default_factory=dict)
    ref_count: int = 0
    last_access: int = 0
    host: torch.Tensor | None = None  # its slots in a second tier (tiered_cache.py)


def as_token_list(token_ids: Sequence[int]) -> list[int]:
    if isinstance(token_ids, list):
        return token_ids  # never mutated; keys are built from slices (copies)
    if isinstance(token_ids, (torch.Tensor, np.ndarray)):
        return list(token_ids.tolist())
    return list(token_ids)


def whole_pages(slots: torch.Tensor, page_size: int, name: str) -> list[int]:
    """The pages of a run of slots that covers whole pages, in order."""
    pages = PageAllocator.slots_to_pages(slots, page_size)
    expected = PageAllocator.pages_to_slots(pages, page_size)
    assert torch.equal(expected, slots), f"{name}: slots not whole pages"
    return list(pages.tolist())
