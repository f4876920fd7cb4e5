"""The host tier: pages of KV in host memory laid out like the device pool's, and the copies
between the two.

On CPU the host pool is a plain second pool and both copies are synchronous. On CUDA it is
pinned; a save (device to host) gathers the pages on the compute stream, so it reads a page
after every write launched before it, into pinned staging, without waiting: the host
scatters the bytes into its pages once they have landed (at a later save), or waits for
them before a load reads the host pages. CPU saves take the same deferred path.
A load (host to device) runs on a side stream, layer by layer, one event per layer: the
first layers compute while later layers are still copied, and attention waits on its
layer's event (`KVPool.wait_layer`). The side stream first waits for the compute stream,
so a freshly allocated device page is never written while earlier work still reads it.
"""

from __future__ import annotations

import torch

from minisgl.extensions.hicache.report import LOADED, PAGES, PAGES_USED, SAVED, TO_DEVICE, TO_HOST
from minisgl.kvcache.allocator import PageAllocator
from minisgl.kvcache.pool import KVPool


def host_pages(gib: float, pool: KVPool) -> int:
    """How many of the pool's pages ``gib`` GiB of host memory hold."""
    per_page = _page_bytes(pool)
    pages = int(gib * 2**30) // per_page
    if pages < 1:
        raise ValueError(f"hicache_size={gib!r} is invalid: less than one page ({per_page} bytes)")
    return pages


def _page_bytes(pool: KVPool) -> int:
    shape = (pool.num_layers, pool.page_size, pool.num_kv_heads, pool.head_dim)
    return KVPool.bytes_per_page(*shape, pool.dtype)


def _raw(buffer: torch.Tensor) -> torch.Tensor:
    """The pool's bytes: index copies have no fp8 kernels on CPU, and bytes are what moves."""
    return buffer.view(torch.uint8)


class HostTier:
    """A `CacheTier` (minisgl/kvcache/tier.py) of ``num_pages`` host pages."""

    def __init__(self, pool: KVPool, num_pages: int, write_through: bool) -> None:
        self.pool, self.page_size = pool, pool.page_size
        self.num_pages, self.write_through = num_pages, write_through
        self.cuda = pool.buffer.device.type == "cuda"
        shape = (2, pool.num_layers, num_pages * pool.page_size, pool.num_kv_heads, pool.head_dim)
        self.buffer = torch.empty(shape, dtype=pool.dtype, pin_memory=self.cuda)
        self.allocator = PageAllocator(num_pages, pool.page_size)
        self.page_bytes = _page_bytes(pool)
        self.totals: dict[str, int] = {}
        self._stream = torch.cuda.Stream(pool.buffer.device) if self.cuda else None
        self._staged: list[torch.Tensor] = []  # a load's host buffers, alive while it copies
        # Saves whose bytes are not in the host pages yet: (host slots, bytes, CUDA event).
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]] = []

    def _count(self, name: str, n: int) -> None:
        self.totals[name] = self.totals.get(name, 0) + n

    # ------------------------------------------------------------ pages
    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free_pages

    def alloc(self, n: int) -> torch.Tensor | None:
        pages = self.allocator.alloc(n)
        self._usage()
        return pages

    def free(self, pages: torch.Tensor) -> None:
        self.allocator.free(pages)
        self._usage()

    def _usage(self) -> None:
        # Set here, not at startup: the scheduler hands the tier its totals after building it.
        self.totals[PAGES] = self.num_pages
        self.totals[PAGES_USED] = self.num_pages - self.num_free_pages

    def free_pages_set(self) -> set[int]:
        return self.allocator.free_pages_set()

    def slots(self, pages: torch.Tensor) -> torch.Tensor:
        return PageAllocator.pages_to_slots(pages, self.page_size)

    # ------------------------------------------------------------ copies
    def save(self, device_pages: torch.Tensor, tier_pages: torch.Tensor) -> None:
        self._settle(wait=False)
        src, dst = self.slots(device_pages), self.slots(tier_pages)
        device = _raw(self.pool.buffer)
        data = device.index_select(2, src.to(device.device))
        event = None
        if self.cuda:  # to pinned staging on the compute stream, without waiting
            staged = torch.empty(data.shape, dtype=torch.uint8, pin_memory=True)
            data = staged.copy_(data, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self._pending.append((dst, data, event))
        self._count(SAVED, dst.numel())
        self._count(TO_HOST, device_pages.numel() * self.page_bytes)

    def settle(self) -> None:
        """Every save's bytes in the host pages (waiting for them on CUDA)."""
        self._settle(wait=True)

    def _settle(self, wait: bool) -> None:
        """Scatter saved bytes into the host pages, oldest first (a page freed and saved
        again takes the later bytes); without ``wait``, only those already on the host."""
        while self._pending:
            dst, data, event = self._pending[0]
            if event is not None and not wait and not event.query():
                return
            if event is not None:
                event.synchronize()
            # index_copy_, not an indexed assignment: that would copy the whole pool (dim 2).
            _raw(self.buffer).index_copy_(2, dst, data)
            self._pending.pop(0)

    def load(self, tier_pages: torch.Tensor, device_pages: torch.Tensor) -> None:
        self.settle()
        src, dst = self.slots(tier_pages), self.slots(device_pages)
        if self._stream is None:
            _raw(self.pool.buffer).index_copy_(2, dst, _raw(self.buffer).index_select(2, src))
        else:
            self._load_layers(src, dst, self._stream)
        self._count(LOADED, dst.numel())
        self._count(TO_DEVICE, device_pages.numel() * self.page_bytes)

    def _load_layers(self, src: torch.Tensor, dst: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """CUDA: the copies on the side stream, one event per layer for attention to wait on."""
        device = self.pool.buffer.device
        stream.wait_stream(torch.cuda.current_stream(device))
        events, staged = [], []
        with torch.cuda.stream(stream):
            index = dst.pin_memory().to(device, non_blocking=True)
            for layer in range(self.pool.num_layers):
                chunk = _raw(self.buffer)[:, layer].index_select(1, src).pin_memory()
                staged.append(chunk)
                _raw(self.pool.buffer)[:, layer].index_copy_(
                    1, index, chunk.to(device, non_blocking=True)
                )
                event = torch.cuda.Event()
                event.record(stream)
                events.append(event)
        self._staged = staged
        self.pool.layer_events = events
