"""Radix-tree prefix cache over page-aligned token runs.

Each non-root node owns a key (token ids, a whole number of pages) and the KV
token slots that hold those tokens. Children are keyed by their first page of
tokens, so a lookup descends one dict probe per node and then confirms the rest
of the node's key with one C-level list comparison.

Recency uses a logical clock (one tick per match/insert) rather than wall time so
that eviction order is deterministic. A node's ``ref_count`` counts the locks
held on it or on any descendant, so ``ref_count == 0`` means "evictable".
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from minisgl.kvcache.allocator import PageAllocator
from minisgl.kvcache.prefix_cache import (
    CacheStats,
    MatchResult,
    PrefixCache,
    check_page_accounting,
    empty_slots,
)
from minisgl.kvcache.radix_node import PageKey, RadixNode, as_token_list, whole_pages

__all__ = ["RadixCache", "RadixNode"]


class RadixCache(PrefixCache):
    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self._next_id = itertools.count()
        self._clock = 0
        self._root = self._new_root()
        self._evictable_pages = 0
        self._protected_pages = 0
        self._looked_up_tokens = 0
        self._matched_tokens = 0

    def match_prefix(self, token_ids: Sequence[int], count: bool = True) -> MatchResult:
        tokens = as_token_list(token_ids)
        node, length, values = self._walk(tokens, self._aligned(len(tokens)))
        if count:
            self._looked_up_tokens += len(tokens)
            self._matched_tokens += length
        slots = torch.cat(values) if values else empty_slots()
        return MatchResult(node=node, length=length, slots=slots)

    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int:
        tokens = as_token_list(token_ids)
        assert slots.dim() == 1 and slots.numel() == len(tokens), (
            f"insert: {slots.numel()} slots for {len(tokens)} tokens"
        )
        end = self._aligned(len(tokens))
        node, present, _ = self._walk(tokens, end)
        if present < end:
            leaf = RadixNode(
                key=tokens[present:end],
                # Copy: the caller's tensor is often a page-table row that gets reused.
                value=slots[present:end].to(device="cpu", dtype=torch.int64, copy=True),
                parent=node,
                node_id=next(self._next_id),
                last_access=self._clock,
            )
            node.children[self._page_key(leaf.key, 0)] = leaf
            self._evictable_pages += (end - present) // self.page_size
        return present

    def _walk(self, tokens: list[int], end: int) -> tuple[RadixNode, int, list[torch.Tensor]]:
        """Descend along tokens[:end] (page-aligned), splitting at a partial match.

        Every node on the matched path gets the current timestamp. Returns the
        deepest matched node, the matched length and the matched nodes' values.
        """
        self._clock += 1
        node, pos, values = self._root, 0, []
        while pos < end:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            matched = self._matched_len(child.key, tokens, pos, end)
            assert matched > 0, "child keyed by its first page must match that page"
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access = self._clock
            values.append(child.value)
            node, pos = child, pos + matched
        return node, pos, values

    def _matched_len(self, key: list[int], tokens: list[int], start: int, end: int) -> int:
        """Page-aligned length of the common prefix of key and tokens[start:end]."""
        n = min(len(key), end - start)
        window = tokens[start : start + n]
        if (key if n == len(key) else key[:n]) == window:
            return n
        # Only the last node of a walk mismatches, so one vectorised scan is enough.
        first_diff = int(np.argmax(np.asarray(key[:n]) != np.asarray(window)))
        return first_diff - first_diff % self.page_size

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut node's key at ``at`` tokens; return the new upper node (the matched part).

        The upper node inherits the ref count (locks on ``node`` still cover the
        whole path) and, for now, the timestamp; the walk then refreshes it because
        it is on the matched path, while the suffix keeps its own timestamp.
        """
        parent = node.parent
        assert parent is not None
        upper = RadixNode(
            key=node.key[:at],
            value=node.value[:at],
            parent=parent,
            node_id=next(self._next_id),
            ref_count=node.ref_count,
            last_access=node.last_access,
        )
        parent.children[self._page_key(upper.key, 0)] = upper
        node.key, node.value, node.parent = node.key[at:], node.value[at:], upper
        upper.children[self._page_key(node.key, 0)] = node
        return upper

    def lock(self, node: object) -> None:
        cur = self._as_node(node)
        while cur is not self._root:
            assert cur.parent is not None, "lock() on an evicted node"
            if cur.ref_count == 0:
                self._move_pages(cur, to_protected=True)
            cur.ref_count += 1
            cur = cur.parent

    def unlock(self, node: object) -> None:
        cur = self._as_node(node)
        while cur is not self._root:
            assert cur.parent is not None, "unlock() on an evicted node"
            assert cur.ref_count > 0, f"unlock() below zero on node {cur.node_id}"
            cur.ref_count -= 1
            if cur.ref_count == 0:
                self._move_pages(cur, to_protected=False)
            cur = cur.parent

    def _move_pages(self, node: RadixNode, *, to_protected: bool) -> None:
        pages = node.value.numel() // self.page_size  # on the device (tiered_cache.py)
        sign = 1 if to_protected else -1
        self._protected_pages += sign * pages
        self._evictable_pages -= sign * pages

    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` device pages where that many are unlocked, least
        recently used leaves first; a parent that the eviction leaves a leaf joins them."""
        if num_pages <= 0:
            return 0
        heap = [(leaf.last_access, leaf.node_id, leaf) for leaf in self._evictable_leaves()]
        heapq.heapify(heap)
        evicted: list[torch.Tensor] = []
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            evicted.append(leaf.value)
            pages = leaf.value.numel() // self.page_size
            self._release_leaf(leaf)
            freed += pages
            self._evictable_pages -= pages
            if parent is not self._root and parent.ref_count == 0 and self._is_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        if evicted:
            slots = torch.cat(evicted)
            self.allocator.free(PageAllocator.slots_to_pages(slots, self.page_size))
        return freed

    def _release_leaf(self, leaf: RadixNode) -> None:
        """An evicted leaf gives up its device pages (the caller frees them): here it leaves
        the tree (a second tier may keep it instead, tiered_cache.py)."""
        self._detach(leaf)

    def _detach(self, node: RadixNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[self._page_key(node.key, 0)]
        node.parent = None  # makes a stale handle fail loudly in lock()/unlock()

    def _holds_device_pages(self, node: RadixNode) -> bool:
        """Every node of the one-tier tree does; a two-tier tree's may hold only tier pages."""
        return True

    def _is_leaf(self, node: RadixNode) -> bool:
        """No child holds device pages: evicting ``node`` frees its pages."""
        return not any(self._holds_device_pages(c) for c in node.children.values())

    def _evictable_leaves(self) -> list[RadixNode]:
        """Unlocked leaves of the subtree of nodes on the device."""
        leaves, stack = [], [self._root]
        while stack:
            node = stack.pop()
            below = [c for c in node.children.values() if self._holds_device_pages(c)]
            if below:
                stack.extend(below)
            elif node is not self._root and node.ref_count == 0:
                leaves.append(node)
        return leaves

    @property
    def evictable_pages(self) -> int:
        return self._evictable_pages

    @property
    def protected_pages(self) -> int:
        return self._protected_pages

    def check_integrity(self, in_use_pages: Iterable[int] = ()) -> None:
        root = self._root
        assert root.parent is None and not root.key and root.value.numel() == 0, "bad root"
        evictable = protected = 0
        tree_pages: list[int] = []
        stack = [root]
        while stack:
            parent = stack.pop()
            for child_key, node in parent.children.items():
                assert self._page_key(node.key, 0) == child_key, f"node {node.node_id}: child key"
                pages = self._check_node(node, parent)
                tree_pages.extend(pages)
                if node.ref_count == 0:
                    evictable += len(pages)
                else:
                    protected += len(pages)
                stack.append(node)
        assert evictable == self._evictable_pages, (
            f"evictable pages counter {self._evictable_pages} != recomputed {evictable}"
        )
        assert protected == self._protected_pages, (
            f"protected pages counter {self._protected_pages} != recomputed {protected}"
        )
        check_page_accounting(self.allocator, tree_pages, in_use_pages)

    def _check_node(self, node: RadixNode, parent: RadixNode) -> list[int]:
        """One node's invariants; returns the device pages it holds."""
        ps, name = self.page_size, f"node {node.node_id}"
        assert node.parent is parent, f"{name}: parent pointer mismatch"
        assert node.key and len(node.key) % ps == 0, (
            f"{name}: key length {len(node.key)} not a positive multiple of {ps}"
        )
        assert node.value.dtype == torch.int64 and node.value.dim() == 1, (
            f"{name}: value must be a 1-D int64 tensor"
        )
        assert node.ref_count >= 0, f"{name}: negative ref count {node.ref_count}"
        if parent is not self._root:
            assert parent.ref_count >= node.ref_count, (
                f"{name}: ref {node.ref_count} > parent ref {parent.ref_count}"
            )
            assert parent.last_access >= node.last_access, f"{name}: more recent than its parent"
        return self._device_pages(node, name)

    def _device_pages(self, node: RadixNode, name: str) -> list[int]:
        assert node.value.numel() == len(node.key), (
            f"{name}: key length {len(node.key)} != value length {node.value.numel()}"
        )
        return whole_pages(node.value, self.page_size, name)

    def reset(self) -> None:
        assert self._protected_pages == 0, "reset() while some prefix is still locked"
        values: list[torch.Tensor] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            values.extend(child.value for child in node.children.values())
            stack.extend(node.children.values())
        if values:
            slots = torch.cat(values)
            self.allocator.free(PageAllocator.slots_to_pages(slots, self.page_size))
        self._root = self._new_root()
        self._evictable_pages = 0
        self._looked_up_tokens = 0
        self._matched_tokens = 0

    @property
    def stats(self) -> CacheStats:
        return CacheStats(self._looked_up_tokens, self._matched_tokens)

    def _new_root(self) -> RadixNode:
        return RadixNode(key=[], value=empty_slots(), parent=None, node_id=next(self._next_id))

    def _as_node(self, node: object) -> RadixNode:
        assert isinstance(node, RadixNode), f"expected a RadixCache node handle, got {node!r}"
        return node

    def _aligned(self, length: int) -> int:
        return length - length % self.page_size

    def _page_key(self, tokens: list[int], pos: int) -> PageKey:
        if self.page_size == 1:
            return tokens[pos]
        return tuple(tokens[pos : pos + self.page_size])
