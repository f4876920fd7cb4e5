"""The radix cache over two tiers: the device pool and a `CacheTier` below it (tier.py).

A node's KV is on the device (``value`` holds its slots), in the tier (``host`` holds its
tier slots), or in both. The nodes on the device hang from the root as one subtree (a
node on the device has its parent there too), because the device evicts leaves of that
subtree, least recently used first: a prefix leaves the device from its end.

- Device eviction saves a node to the tier first (write-back) unless it is there already
  (write-through saved it when it was first cached); with no room in the tier even after
  tier eviction, the node leaves the tree with its tier-only descendants.
- Tier eviction frees whole nodes, least recently used first: a tier-only leaf leaves the
  tree, a node also on the device only loses its tier copy. Locked nodes are kept.
- Matching walks both tiers: the device part is the match, the tier-only part below it its
  ``host_length``; `load` gives that part device pages and copies it back.
- Inserting over tier-only nodes hands them the caller's device pages (KV it recomputed) and
  frees their tier copy, so a node's two copies always hold one copy's bytes."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

import torch

from minisgl.kvcache.allocator import PageAllocator
from minisgl.kvcache.prefix_cache import MatchResult, check_page_accounting, empty_slots
from minisgl.kvcache.radix_cache import RadixCache
from minisgl.kvcache.radix_node import RadixNode, as_token_list, whole_pages
from minisgl.kvcache.tier import CacheTier

Walk = tuple[RadixNode, int, list[torch.Tensor], RadixNode, int]


def _on_device(node: RadixNode) -> bool:
    return node.value.numel() > 0


class TieredRadixCache(RadixCache):
    def __init__(self, allocator: PageAllocator, tier: CacheTier) -> None:
        super().__init__(allocator)
        self.tier = tier
        self._tier_pages: list[int] = []  # collected by check_integrity

    # ------------------------------------------------------------ matching and loading
    def match_prefix(self, token_ids: Sequence[int], count: bool = True) -> MatchResult:
        tokens = as_token_list(token_ids)
        node, length, values, deepest, end = self._walk_tiers(tokens, self._aligned(len(tokens)))
        if count:
            self._looked_up_tokens += len(tokens)
            self._matched_tokens += end
        slots = torch.cat(values) if values else empty_slots()
        in_tier = end - length
        return MatchResult(node, length, slots, in_tier, deepest if in_tier else None)

    def _walk_tiers(self, tokens: list[int], end: int) -> Walk:
        """Descend along tokens[:end] over both tiers, splitting at a partial match. Returns
        the deepest node on the device, its length and the device slots down to it, then
        the deepest matched node (in either tier) and its length."""
        self._clock += 1
        cur, pos, values = self._root, 0, []
        device, length = self._root, 0
        while pos < end:
            child = cur.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            matched = self._matched_len(child.key, tokens, pos, end)
            assert matched > 0, "child keyed by its first page must match that page"
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access = self._clock
            cur, pos = child, pos + matched
            if _on_device(child):
                values.append(child.value)
                device, length = child, pos
        return device, length, values, cur, pos

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        host = node.host
        upper = super()._split(node, at)
        if host is not None:
            upper.host, node.host = host[:at], host[at:]
        return upper

    def load(self, match: MatchResult) -> MatchResult:
        if not match.host_length:
            return match
        tail = self._as_node(match.host_node)
        chain = _tier_only_path(tail)
        self.lock(tail)  # neither eviction may take the path while pages are found
        try:
            loaded = self._load_chain(chain)
        finally:
            self.unlock(tail)
        if not loaded:
            return match
        tokens = sum(len(n.key) for n in loaded)
        slots = torch.cat([match.slots, *(n.value for n in loaded)])
        rest = match.host_length - tokens
        return MatchResult(loaded[-1], match.length + tokens, slots, rest, tail if rest else None)

    def _load_chain(self, chain: list[RadixNode]) -> list[RadixNode]:
        """Device pages for the longest leading run of ``chain`` (locked tier-only nodes,
        top down) that fits, and its KV copied back; returns that run."""
        ps = self.page_size
        sizes = [len(n.key) // ps for n in chain]
        short = sum(sizes) - self.allocator.num_free_pages
        if short > 0:
            self.evict(short)
        room, take = self.allocator.num_free_pages, 0
        while take < len(chain) and sizes[take] <= room:
            room -= sizes[take]
            take += 1
        pages = self.allocator.alloc(sum(sizes[:take]))
        if not take or pages is None:
            return []
        tier = torch.cat([n.host for n in chain[:take] if n.host is not None])
        self.tier.load(PageAllocator.slots_to_pages(tier, ps), pages)
        at = 0
        for node, n in zip(chain[:take], sizes):
            node.value = PageAllocator.pages_to_slots(pages[at : at + n], ps)
            self._protected_pages += n  # locked now; unlock moves the pages to evictable
            at += n
        return chain[:take]

    # ------------------------------------------------------------ inserting
    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int:
        tokens = as_token_list(token_ids)
        assert slots.dim() == 1 and slots.numel() == len(tokens), (
            f"insert: {slots.numel()} slots for {len(tokens)} tokens"
        )
        end = self._aligned(len(tokens))
        _, present, _, cur, pos = self._walk_tiers(tokens, end)
        slots = slots.to(device="cpu", dtype=torch.int64)
        at = present
        for node in _tier_only_path(cur) if pos > present else []:
            self._adopt(node, slots[at : at + len(node.key)].clone())
            at += len(node.key)
        if pos < end:
            leaf = RadixNode(
                key=tokens[pos:end],
                value=slots[pos:end].clone(),
                parent=cur,
                node_id=next(self._next_id),
                last_access=self._clock,
            )
            cur.children[self._page_key(leaf.key, 0)] = leaf
            self._evictable_pages += (end - pos) // self.page_size
            if self.tier.write_through:
                self._save(leaf)
        return present

    def _adopt(self, node: RadixNode, slots: torch.Tensor) -> None:
        """A tier-only node takes the caller's device slots; its tier copy is freed."""
        self._free_tier_copy(node)
        node.value = slots
        self._evictable_pages += len(node.key) // self.page_size  # tier-only: unlocked
        if self.tier.write_through:
            self._save(node)

    # ------------------------------------------------------------ eviction
    def _release_leaf(self, leaf: RadixNode) -> None:
        """The leaf keeps its KV in the tier (saved now unless already there), else leaves
        the tree with what hangs below it."""
        if leaf.host is None and not self._save(leaf):
            self._remove_subtree(leaf)
        leaf.value = empty_slots()

    def _holds_device_pages(self, node: RadixNode) -> bool:
        return _on_device(node)

    def _save(self, node: RadixNode) -> bool:
        """Copy a device node into the tier (making room there); False if there is none."""
        pages = self._alloc_tier(len(node.key) // self.page_size)
        if pages is None:
            return False
        self.tier.save(PageAllocator.slots_to_pages(node.value, self.page_size), pages)
        node.host = PageAllocator.pages_to_slots(pages, self.page_size)
        return True

    def _alloc_tier(self, n: int) -> torch.Tensor | None:
        if n > self.tier.num_free_pages:
            self._evict_tier(n - self.tier.num_free_pages)
        return self.tier.alloc(n)

    def _evict_tier(self, num_pages: int) -> None:
        heap = [(n.last_access, n.node_id, n) for n in self._iter_nodes() if _tier_evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            freed += self._free_tier_copy(node)
            if not _on_device(node):
                self._detach(node)
                if parent is not None and parent is not self._root and _tier_evictable(parent):
                    heapq.heappush(heap, (parent.last_access, parent.node_id, parent))

    def _free_tier_copy(self, node: RadixNode) -> int:
        if node.host is None:
            return 0
        pages = PageAllocator.slots_to_pages(node.host, self.page_size)
        self.tier.free(pages)
        node.host = None
        return pages.numel()

    def _remove_subtree(self, node: RadixNode) -> None:
        """Take ``node`` out of the tree with its descendants (tier-only: their tier pages
        are freed; the caller frees node's device pages)."""
        stack = list(node.children.values())
        while stack:
            below = stack.pop()
            stack.extend(below.children.values())
            self._free_tier_copy(below)
            below.parent = None
        node.children.clear()
        self._detach(node)

    def _iter_nodes(self) -> Iterable[RadixNode]:  # every node but the root
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    # ------------------------------------------------------------ flush and checks
    def reset(self) -> None:
        hosts = [n.host for n in self._iter_nodes() if n.host is not None]
        super().reset()
        if hosts:
            self.tier.free(PageAllocator.slots_to_pages(torch.cat(hosts), self.page_size))

    def check_integrity(self, in_use_pages: Iterable[int] = ()) -> None:
        """The device's accounting (the base check), then the tier's: every tier page is
        free or some node's, and each node is in at least one tier."""
        self._tier_pages = []
        super().check_integrity(in_use_pages)
        check_page_accounting(self.tier, self._tier_pages, ())

    def _device_pages(self, node: RadixNode, name: str) -> list[int]:
        parent = node.parent
        assert parent is not None
        if node.host is not None:
            assert node.host.numel() == len(node.key), f"{name}: tier slots != key length"
            self._tier_pages.extend(whole_pages(node.host, self.page_size, name))
        if not _on_device(node):
            assert node.host is not None, f"{name}: its KV is in neither tier"
            assert node.ref_count == 0, f"{name}: locked while only in the tier"
            return []
        assert parent is self._root or _on_device(parent), f"{name}: on the device, parent not"
        return super()._device_pages(node, name)


def _tier_evictable(node: RadixNode) -> bool:
    """Whether tier eviction may take the node's tier copy (whole nodes, leaves first)."""
    return node.host is not None and node.ref_count == 0 and (_on_device(node) or not node.children)


def _tier_only_path(node: RadixNode) -> list[RadixNode]:
    """The tier-only nodes from the device subtree down to ``node``, top down."""
    path = []
    cur: RadixNode | None = node
    while cur is not None and cur.parent is not None and not _on_device(cur):
        path.append(cur)
        cur = cur.parent
    return path[::-1]
