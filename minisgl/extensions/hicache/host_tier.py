"""The host tier: pages of KV in host memory, and the copies between it and the device pool.

On CPU the host pool is a plain second pool and the copies are synchronous row copies. On
CUDA it is pinned, and the GPU moves the pages itself (transfer.py reads and writes the
mapped host memory directly). A save (device to host) runs on the compute stream, so it
reads a page after every write launched before it. A load (host to device) runs on a side
stream, layer by layer, one event per layer: the first layers compute while later layers
are still copied, and attention waits on its layer's event (`KVPool.wait_layer`). The side
stream first waits for the compute stream (a freshly allocated device page is never
written while earlier work still reads it, and every earlier save has landed), and the
compute stream waits for the last load before its next save (a host page freed after a
load is not overwritten while the load still reads it).
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


def _rows(pool: KVPool) -> torch.Tensor:
    """The device pool's bytes as [2 (K, V), layers, pages, page bytes of one side]."""
    raw = pool.buffer.view(torch.uint8)  # bytes move; index copies have no fp8 CPU kernels
    return raw.view(2, pool.num_layers, pool.num_slots // pool.page_size, -1)


class HostTier:
    """A `CacheTier` (minisgl/kvcache/tier.py) of ``num_pages`` host pages."""

    def __init__(self, pool: KVPool, num_pages: int, write_through: bool) -> None:
        self.pool, self.page_size = pool, pool.page_size
        self.num_pages, self.write_through = num_pages, write_through
        self.cuda = pool.buffer.device.type == "cuda"
        # Page-major within a layer: one page's K and V of a layer are one contiguous row, so
        # gathering or scattering pages on the host copies whole rows (memcpy speed), where
        # the device pool's layout would copy 2-byte elements one by one.
        layers, ps, heads, dim = pool.num_layers, pool.page_size, pool.num_kv_heads, pool.head_dim
        shape = (layers, num_pages, 2, ps, heads, dim)
        self.buffer = torch.empty(shape, dtype=pool.dtype, pin_memory=self.cuda)
        self.rows = self.buffer.view(torch.uint8).view(layers, num_pages, -1)
        self.allocator = PageAllocator(num_pages, pool.page_size)
        self.page_bytes = _page_bytes(pool)
        self.totals: dict[str, int] = {}
        self._stream = torch.cuda.Stream(pool.buffer.device) if self.cuda else None
        self._last_load: torch.cuda.Event | None = None

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

    def host_kv(self, slots: torch.Tensor) -> torch.Tensor:
        """The K/V of host slots in the device pool's layout, [2, layers, n, heads, dim]."""
        pages, offsets = slots // self.page_size, slots % self.page_size
        return self.buffer[:, pages, :, offsets].permute(2, 1, 0, 3, 4)

    # ------------------------------------------------------------ copies
    def save(self, device_pages: torch.Tensor, tier_pages: torch.Tensor) -> None:
        if self.cuda:
            from minisgl.extensions.hicache.transfer import copy_pages  # Triton: CUDA hosts

            if self._last_load is not None:
                torch.cuda.current_stream().wait_event(self._last_load)
            device = self.pool.buffer.device
            src, dst = _on(device_pages, device), _on(tier_pages, device)
            copy_pages(self._device_view(), src, self._host_view(), dst)
        else:
            picked = _rows(self.pool).index_select(2, device_pages)  # [2, L, n, half]
            rows = picked.permute(1, 2, 0, 3).reshape(self.pool.num_layers, len(tier_pages), -1)
            for layer in range(self.pool.num_layers):  # row copies: no element-wise kernel
                self.rows[layer].index_copy_(0, tier_pages, rows[layer])
        self._count(SAVED, tier_pages.numel() * self.page_size)
        self._count(TO_HOST, device_pages.numel() * self.page_bytes)

    def settle(self) -> None:
        """Every copy launched so far has landed (for checks that read the host pages)."""
        if self.cuda:
            torch.cuda.synchronize(self.pool.buffer.device)

    def load(self, tier_pages: torch.Tensor, device_pages: torch.Tensor) -> None:
        if self._stream is None:
            device = _rows(self.pool)
            for layer in range(self.pool.num_layers):
                halves = self.rows[layer].index_select(0, tier_pages).view(len(tier_pages), 2, -1)
                device[0, layer].index_copy_(0, device_pages, halves[:, 0])
                device[1, layer].index_copy_(0, device_pages, halves[:, 1])
        else:
            self._load_layers(tier_pages, device_pages, self._stream)
        self._count(LOADED, device_pages.numel() * self.page_size)
        self._count(TO_DEVICE, device_pages.numel() * self.page_bytes)

    def _load_layers(
        self, tier_pages: torch.Tensor, device_pages: torch.Tensor, stream: torch.cuda.Stream
    ) -> None:
        """CUDA: the copies on the side stream, one event per layer for attention to wait on."""
        from minisgl.extensions.hicache.transfer import copy_pages

        device = self.pool.buffer.device
        stream.wait_stream(torch.cuda.current_stream(device))
        host, pool = self._host_view(), self._device_view()
        events = []
        with torch.cuda.stream(stream):
            src, dst = _on(tier_pages, device), _on(device_pages, device)
            for layer in range(self.pool.num_layers):
                copy_pages(host[layer : layer + 1], src, pool[layer : layer + 1], dst)
                event = torch.cuda.Event()
                event.record(stream)
                events.append(event)
        self._last_load = events[-1]
        self.pool.layer_events = events

    def _host_view(self) -> torch.Tensor:
        layers, pages = self.rows.shape[:2]
        return words(self.rows.view(layers, pages, 2, -1).permute(0, 2, 1, 3))

    def _device_view(self) -> torch.Tensor:
        return words(_rows(self.pool).permute(1, 0, 2, 3))


def words(view: torch.Tensor) -> torch.Tensor:
    """A [layers, 2, pages, bytes] uint8 view as the widest words its rows divide into."""
    for dtype in (torch.int64, torch.int32):
        if view.shape[-1] % dtype.itemsize == 0:
            return view.view(dtype)
    return view


def _on(pages: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Page ids on the device, copied without a host wait."""
    return pages.to(torch.int64).pin_memory().to(device, non_blocking=True)
