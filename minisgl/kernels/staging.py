"""Host-to-device staging: a step's index arrays packed into one pinned buffer, one copy.

Two things make this more than ``torch.tensor(...).pin_memory().to(device)``:

* ``pin_memory()`` allocates page-locked memory on every call; a small ring of pinned
  buffers, each reused once the copy that last read it has run (an event says so), avoids
  that cost on every step.
* Every segment starts 16-byte aligned. Triton specialises a kernel on whether each pointer
  argument is 16-byte aligned, so views at arbitrary offsets of a packed buffer would make it
  compile new variants (a second or more each) in the middle of serving.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_ALIGN_BYTES = 16
_NP_DTYPES = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}

Segment = Sequence[int] | Sequence[float] | np.ndarray | torch.Tensor


def _aligned(n: int, itemsize: int) -> int:
    per = _ALIGN_BYTES // itemsize
    return -(-n // per) * per


class DeviceStager:
    """Packs host segments of one dtype and copies them to ``device`` with one transfer."""

    def __init__(self, device: torch.device, ring: int = 8) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._ring: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._next = 0
        self._ring_size = ring
        self._index: int | None = device.index  # resolved on the first CUDA staging

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """A pinned byte buffer no pending copy reads from (grown when too small)."""
        i = self._next
        self._next = (i + 1) % self._ring_size
        if i < len(self._ring):
            buf, event = self._ring[i]
            if event is not None:
                event.synchronize()  # the copy that last read it has run (normally long ago)
            if buf.numel() >= nbytes:
                return buf
        buf = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8, pin_memory=True)
        if i < len(self._ring):
            self._ring[i] = (buf, self._ring[i][1])  # its event is kept for the next record
        else:
            self._ring.append((buf, None))
        return buf

    def _record(self, slot: int) -> None:
        """Mark the slot's buffer as read by the copy just issued. The slot's event is made
        once and re-recorded, on the stream named by device index: the current-device
        lookup behind a bare ``record()`` costs more host time than the copy itself."""
        buf, event = self._ring[slot]
        if event is None:
            event = torch.cuda.Event()
            self._ring[slot] = (buf, event)
        if self._index is None:
            self._index = torch.cuda.current_device()
        event.record(torch.cuda.current_stream(self._index))

    def stage(self, segments: Sequence[Segment], dtype: torch.dtype) -> list[torch.Tensor]:
        """Device tensors holding ``segments`` (views of one buffer, each 16-byte aligned)."""
        return self.stage_flat(segments, dtype)[1]

    def stage_flat(
        self, segments: Sequence[Segment], dtype: torch.dtype
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """As ``stage``, plus the one device buffer the views share (views made under
        inference mode do not record their ``_base``)."""
        arrays, offsets, total = _layout(segments, dtype)
        if not self.pinned:
            flat = torch.zeros(total, dtype=dtype)
            _fill(flat.numpy(), arrays, offsets)
            return flat, [flat[off : off + len(a)] for a, off in zip(arrays, offsets)]
        slot = self._next
        host = self._host(total, dtype, arrays, offsets)
        dev = host.to(self.device, non_blocking=True)
        self._record(slot)
        return dev, [dev[off : off + len(a)] for a, off in zip(arrays, offsets)]

    def stage_into(self, dst: torch.Tensor, segments: Sequence[Segment]) -> None:
        """Write ``segments`` into ``dst``, a device buffer of ``stage_flat``'s layout for
        segments of the same lengths (a captured graph's metadata), with one copy."""
        arrays, offsets, total = _layout(segments, dst.dtype)
        assert dst.dim() == 1 and dst.numel() == total, (dst.shape, total)
        if not self.pinned:
            _fill(dst.numpy(), arrays, offsets)
            return
        slot = self._next
        dst.copy_(self._host(total, dst.dtype, arrays, offsets), non_blocking=True)
        self._record(slot)

    def _host(
        self, total: int, dtype: torch.dtype, arrays: list[np.ndarray], offsets: list[int]
    ) -> torch.Tensor:
        """The next ring slot's pinned buffer as ``total`` elements holding the segments."""
        nbytes = total * dtype.itemsize
        host = self._buffer(nbytes)[:nbytes].view(dtype)
        _fill(host.numpy(), arrays, offsets)
        return host


def _layout(
    segments: Sequence[Segment], dtype: torch.dtype
) -> tuple[list[np.ndarray], list[int], int]:
    """The segments as arrays, each one's 16-byte-aligned offset, and the elements in all."""
    np_dtype = _NP_DTYPES[dtype]
    arrays = [_as_array(s, np_dtype) for s in segments]
    itemsize = np.dtype(np_dtype).itemsize
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += _aligned(len(a), itemsize)
    return arrays, offsets, total


def _fill(host: np.ndarray, arrays: list[np.ndarray], offsets: list[int]) -> None:
    for a, off in zip(arrays, offsets):
        host[off : off + len(a)] = a


def _as_array(s: Segment, np_dtype: type) -> np.ndarray:
    if isinstance(s, torch.Tensor):
        return s.numpy().astype(np_dtype, copy=False)
    return np.asarray(s, dtype=np_dtype)
