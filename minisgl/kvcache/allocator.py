"""Page allocator for the paged KV pool (CPU-side bookkeeping only).

The KV pool holds ``num_pages * page_size`` token slots; token slot index is
``page_id * page_size + offset``. This allocator only hands out page ids; the
caches and the scheduler convert between pages and token slots with the static
helpers below.
"""

from __future__ import annotations

import numpy as np
import torch


def zeroed_page_table(rows: int, width: int, device: torch.device) -> torch.Tensor:
    """An int64 page table of zeros. On the host it comes from calloc (through numpy), so
    the pages of rows a request never reaches are never made resident: the table is sized
    for ``max_running_requests`` full contexts (16 MiB on CPU by default) and a short
    request touches one page of its row."""
    if device.type == "cpu":
        return torch.from_numpy(np.zeros((rows, width), dtype=np.int64))
    return torch.zeros(rows, width, dtype=torch.int64, device=device)


class PageAllocator:
    """A LIFO free list of page ids with a cheap double-free check.

    Free pages live in ``_free_stack[:_num_free]``. A parallel bool tensor records
    the free-state of every page so that ``free`` can reject double frees without
    scanning the free list.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        assert num_pages >= 0, f"num_pages must be >= 0, got {num_pages}"
        assert page_size >= 1, f"page_size must be >= 1, got {page_size}"
        self.num_pages: int = num_pages
        self.page_size: int = page_size
        self._free_stack = torch.empty(num_pages, dtype=torch.int64)
        self._is_free = torch.empty(num_pages, dtype=torch.bool)
        self._num_free = 0
        self.reset()

    @property
    def num_free_pages(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """Return ``n`` page ids (int64 CPU tensor), or None (allocating nothing) if short."""
        assert n >= 0, f"cannot allocate a negative number of pages ({n})"
        if n > self._num_free:
            return None
        top = self._num_free
        # The stack top holds the lowest ids after a reset; flipping keeps a fresh
        # allocator handing out 0, 1, 2, ... which makes logs and tests easy to read.
        pages = self._free_stack[top - n : top].flip(0).clone()
        self._num_free = top - n
        self._is_free[pages] = False
        return pages

    def free(self, pages: torch.Tensor) -> None:
        """Return page ids to the free list; AssertionError on a double free or a bad id."""
        assert pages.dim() == 1, (
            f"expected a 1-D tensor of page ids, got shape {tuple(pages.shape)}"
        )
        n = pages.numel()
        if n == 0:
            return
        pages = pages.to(dtype=torch.int64, device="cpu")
        lo, hi = int(pages.min()), int(pages.max())
        assert 0 <= lo and hi < self.num_pages, (
            f"page id out of range [0, {self.num_pages}): min={lo} max={hi}"
        )
        already_free = self._is_free[pages]
        if bool(already_free.any()):
            dup = pages[already_free].tolist()
            raise AssertionError(f"double free of page(s) {dup}")
        # A page listed twice in one call would slip past the free-state check.
        assert pages.unique().numel() == n, f"page ids repeated within one free(): {pages.tolist()}"
        self._is_free[pages] = True
        self._free_stack[self._num_free : self._num_free + n] = pages
        self._num_free += n

    def free_pages_set(self) -> set[int]:
        """The set of currently free page ids (for integrity checks; O(num_free))."""
        return set(self._free_stack[: self._num_free].tolist())

    def reset(self) -> None:
        """Mark every page free again (forgets all outstanding allocations)."""
        self._free_stack.copy_(torch.arange(self.num_pages - 1, -1, -1, dtype=torch.int64))
        self._is_free.fill_(True)
        self._num_free = self.num_pages

    @staticmethod
    def pages_to_slots(pages: torch.Tensor, page_size: int) -> torch.Tensor:
        """Expand page ids to the token slots they cover, page by page (int64)."""
        if page_size == 1:
            return pages.to(torch.int64, copy=True)  # a page is a slot
        offsets = torch.arange(page_size, dtype=torch.int64)
        return (pages.to(torch.int64).unsqueeze(1) * page_size + offsets).reshape(-1)

    @staticmethod
    def slots_to_pages(slots: torch.Tensor, page_size: int) -> torch.Tensor:
        """Page ids of a run of token slots that starts on a page boundary.

        The run may end mid-page (a request's partial tail page): every page that
        the run touches is reported once.
        """
        return slots[::page_size].to(torch.int64) // page_size
