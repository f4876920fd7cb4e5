from __future__ import annotations

import psutil
import pytest
import torch

from minisgl.kvcache.allocator import PageAllocator, zeroed_page_table


def test_fresh_allocator_hands_out_ascending_pages() -> None:
    alloc = PageAllocator(num_pages=8, page_size=4)
    assert alloc.num_pages == 8 and alloc.page_size == 4
    assert alloc.num_free_pages == 8
    pages = alloc.alloc(3)
    assert pages is not None
    assert pages.dtype == torch.int64 and pages.device.type == "cpu"
    assert pages.tolist() == [0, 1, 2]
    assert alloc.num_free_pages == 5
    assert alloc.free_pages_set() == {3, 4, 5, 6, 7}


def test_alloc_zero_and_exact() -> None:
    alloc = PageAllocator(num_pages=4, page_size=1)
    empty = alloc.alloc(0)
    assert empty is not None and empty.numel() == 0
    pages = alloc.alloc(4)
    assert pages is not None and sorted(pages.tolist()) == [0, 1, 2, 3]
    assert alloc.num_free_pages == 0
    assert alloc.free_pages_set() == set()


def test_alloc_returns_none_and_allocates_nothing_when_short() -> None:
    alloc = PageAllocator(num_pages=4, page_size=2)
    assert alloc.alloc(3) is not None
    assert alloc.alloc(2) is None
    assert alloc.num_free_pages == 1
    assert alloc.free_pages_set() == {3}


def test_free_returns_pages_and_they_are_reused() -> None:
    alloc = PageAllocator(num_pages=4, page_size=2)
    pages = alloc.alloc(4)
    assert pages is not None
    alloc.free(pages[1:3])
    assert alloc.num_free_pages == 2
    assert alloc.free_pages_set() == {1, 2}
    again = alloc.alloc(2)
    assert again is not None and sorted(again.tolist()) == [1, 2]
    assert alloc.num_free_pages == 0


def test_free_empty_is_noop() -> None:
    alloc = PageAllocator(num_pages=2, page_size=1)
    alloc.free(torch.empty(0, dtype=torch.int64))
    assert alloc.num_free_pages == 2


def test_double_free_raises() -> None:
    alloc = PageAllocator(num_pages=4, page_size=1)
    pages = alloc.alloc(2)
    assert pages is not None
    alloc.free(pages)
    with pytest.raises(AssertionError, match="double free"):
        alloc.free(pages[:1])
    # Never allocated at all counts as a double free too.
    with pytest.raises(AssertionError, match="double free"):
        alloc.free(torch.tensor([3]))
    assert alloc.num_free_pages == 4


def test_repeated_page_within_one_free_raises() -> None:
    alloc = PageAllocator(num_pages=4, page_size=1)
    assert alloc.alloc(4) is not None
    with pytest.raises(AssertionError):
        alloc.free(torch.tensor([2, 2]))


def test_out_of_range_free_raises() -> None:
    alloc = PageAllocator(num_pages=4, page_size=1)
    assert alloc.alloc(4) is not None
    with pytest.raises(AssertionError, match="out of range"):
        alloc.free(torch.tensor([4]))
    with pytest.raises(AssertionError, match="out of range"):
        alloc.free(torch.tensor([-1]))


def test_reset_frees_everything() -> None:
    alloc = PageAllocator(num_pages=5, page_size=2)
    assert alloc.alloc(4) is not None
    alloc.reset()
    assert alloc.num_free_pages == 5
    assert alloc.free_pages_set() == set(range(5))
    pages = alloc.alloc(5)
    assert pages is not None and pages.tolist() == [0, 1, 2, 3, 4]


def test_pages_to_slots() -> None:
    slots = PageAllocator.pages_to_slots(torch.tensor([3, 0]), 4)
    assert slots.dtype == torch.int64
    assert slots.tolist() == [12, 13, 14, 15, 0, 1, 2, 3]
    assert PageAllocator.pages_to_slots(torch.tensor([5, 2]), 1).tolist() == [5, 2]
    assert PageAllocator.pages_to_slots(torch.empty(0, dtype=torch.int64), 4).numel() == 0


def test_slots_to_pages_round_trips_and_handles_partial_tail() -> None:
    pages = torch.tensor([7, 1, 4])
    slots = PageAllocator.pages_to_slots(pages, 4)
    assert PageAllocator.slots_to_pages(slots, 4).tolist() == [7, 1, 4]
    # A run ending mid-page still reports the touched tail page once.
    assert PageAllocator.slots_to_pages(slots[:9], 4).tolist() == [7, 1, 4]
    assert PageAllocator.slots_to_pages(slots[:8], 4).tolist() == [7, 1]


def test_host_page_table_is_resident_only_where_written() -> None:
    """The CPU engine's page table is sized for every request at full context; only the
    rows requests reach may take memory (RSS - KV is one of issue 29's targets)."""
    proc = psutil.Process()
    before = proc.memory_info().rss
    table = zeroed_page_table(1025, 8193, torch.device("cpu"))  # 64 MiB of int64
    table[:16, :300] = 7  # sixteen short requests
    grown = (proc.memory_info().rss - before) / 2**20
    assert table.dtype == torch.int64 and table.shape == (1025, 8193)
    assert int(table[16:].abs().sum()) == 0 and int(table[:16, 300:].abs().sum()) == 0
    assert grown < 16, grown  # written as zeros it would be 64 MiB
