"""Host-to-device staging and the Triton metadata a CUDA graph replays."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from minisgl.attention.base import BatchLayout
from minisgl.attention.triton_backend import TritonBackend
from minisgl.kernels.staging import DeviceStager, Segment
from minisgl.kvcache.pool import KVPool


def test_segments_are_aligned_and_exact() -> None:
    stager = DeviceStager(torch.device("cpu"))
    segments: list[Segment] = [[1, 2, 3], np.arange(5), torch.tensor([7]), [], (9, 10)]
    for dtype in (torch.int32, torch.int64):
        with torch.inference_mode():
            flat, views = stager.stage_flat(segments, dtype)
        for seg, view in zip(segments, views):
            assert view.dtype == dtype
            assert view.tolist() == list(np.asarray(seg).tolist())
            # Triton specialises on 16-byte pointer alignment: every segment starts aligned.
            assert view.data_ptr() % 16 == 0
            assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def _layout(table: torch.Tensor, rows: list[int], seq: list[int]) -> BatchLayout:
    return BatchLayout(rows, [s - 1 for s in seq], [1] * len(seq), table)


def test_refresh_rewrites_every_field_in_place() -> None:
    """A captured graph reads the views of its metadata's buffer: refreshing it with a new
    batch must update every field in that buffer (made under inference mode as the engine
    does), exactly as a fresh prepare lays them out."""
    pool = KVPool(1, 64, 1, 2, 16, torch.float32, torch.device("cpu"))
    table = torch.zeros(8, 64, dtype=torch.int64)
    backend = TritonBackend(pool, stager=DeviceStager(torch.device("cpu")), num_sms=4)
    layout = _layout(table, [0, 3, 5], [40, 9, 600])
    with torch.inference_mode():
        captured = backend.prepare(_layout(table, [7, 7, 7], [1, 1, 1]), torch.device("cpu"))
        buffer = captured.packed.data_ptr()
        backend.refresh(captured, layout, torch.device("cpu"))
        fresh = backend.prepare(layout, torch.device("cpu"))
    assert captured.packed.data_ptr() == buffer
    for name in ("row_ids", "prefix_lens", "extend_lens", "seq_lens", "num_splits"):
        assert getattr(captured, name).tolist() == getattr(fresh, name).tolist(), name
    assert captured.seq_lens.tolist() == [40, 9, 600]


def test_stage_into_writes_stage_flats_layout() -> None:
    """stage_into fills a buffer laid out as stage_flat lays out segments of those lengths
    (each at its 16-byte-aligned offset); a buffer of another size is refused."""
    stager = DeviceStager(torch.device("cpu"))
    old: list[Segment] = [[1, 2, 3], np.arange(5), [], [4]]
    new: list[Segment] = [[9, 8, 7], np.arange(50, 55), [], [6]]
    flat, views = stager.stage_flat(old, torch.int32)
    stager.stage_into(flat, new)
    assert [v.tolist() for v in views] == [np.asarray(s).tolist() for s in new]
    with pytest.raises(AssertionError):
        stager.stage_into(flat, [[1, 2, 3, 4, 5]])


class _LaggingDevice:
    """A device that runs nothing until an event is synchronized: every non-blocking copy
    stays pending (its source not yet read) until an event recorded after it is waited on,
    as on a device busy with earlier work. A staging ring that rewrote a slot's pinned
    buffer before waiting on the slot's event would make that copy read the new data."""

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (source, destination)
        self.log: list[tuple[str, int]] = []  # ("record" | "synchronize", event id)
        self.events = 0
        self.copied = 0  # copies run so far

    def flush(self, upto: int) -> None:
        for src, dst in self.pending[:upto]:
            dst.copy_(src)
        del self.pending[:upto]
        self.copied += upto


def _lagging_stager(
    monkeypatch: pytest.MonkeyPatch, ring: int
) -> tuple[DeviceStager, _LaggingDevice]:
    from minisgl.kernels import staging

    dev = _LaggingDevice()
    original_to = torch.Tensor.to

    def deferred_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not kwargs.get("non_blocking"):
            return original_to(self, *args, **kwargs)
        dst = torch.full_like(self, -1)  # what a copy not yet run leaves behind
        dev.pending.append((self, dst))
        return dst

    class Event:
        def __init__(self) -> None:
            self.id = dev.events
            dev.events += 1
            self.upto: int | None = None

        def record(self, stream: object = None) -> None:
            self.upto = dev.copied + len(dev.pending)  # the copies issued before it
            dev.log.append(("record", self.id))

        def synchronize(self) -> None:
            assert self.upto is not None
            dev.log.append(("synchronize", self.id))
            dev.flush(max(0, self.upto - dev.copied))

    class TorchShim:
        """staging.py's ``torch``: pinned allocation and CUDA events faked on the CPU."""

        cuda = SimpleNamespace(
            Event=Event, current_device=lambda: 0, current_stream=lambda index=None: None
        )

        @staticmethod
        def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
            return torch.empty(*args, **kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

    monkeypatch.setattr(staging, "torch", TorchShim())
    monkeypatch.setattr(torch.Tensor, "to", deferred_to)
    stager = DeviceStager(torch.device("cpu"), ring=ring)
    stager.pinned = True  # the CUDA path: a ring of pinned buffers, non-blocking copies
    return stager, dev


def test_ring_slot_reuse_waits_for_the_copy_that_read_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGLang #103's hazard: a slot reused while an earlier async copy still reads it. With
    a device that runs a copy only once an event after it is waited on, every staged result
    must still equal its own input over more stagings than the ring has slots."""
    stager, dev = _lagging_stager(monkeypatch, ring=2)
    inputs: list[list[Segment]] = [
        [np.arange(100 * i, 100 * i + 5 + i), [i] * (3 + i), np.full(2 * i + 1, -i)]
        for i in range(6)
    ]
    outs = []
    for i, segments in enumerate(inputs):
        outs.append(stager.stage(segments, torch.int64))
        # Reusing slot i % 2 first waits on the slot's event, last recorded by the staging
        # that used it last (staging i - 2), and on nothing else; then records it again.
        want = [("synchronize", i % 2)] if i >= 2 else []
        assert dev.log[-1 - len(want) : -1] == want, dev.log
        assert dev.log[-1] == ("record", i % 2)
        assert dev.events == min(i + 1, 2)  # one event per slot, made once
    # Two copies still pending (the device lags); the rest ran, each before its slot's
    # buffer was written again.
    assert len(dev.pending) == 2
    dev.flush(len(dev.pending))  # torch.cuda.synchronize()
    for segments, views in zip(inputs, outs):
        for seg, view in zip(segments, views):
            assert view.tolist() == np.asarray(seg).tolist()


def test_ring_reuse_without_the_wait_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake device above does catch the hazard: a stager that skips the wait before
    reusing a slot returns another staging's data."""
    stager, dev = _lagging_stager(monkeypatch, ring=2)
    orig_buffer = DeviceStager._buffer

    def no_wait(self: DeviceStager, nbytes: int) -> torch.Tensor:
        self._ring = [(buf, None) for buf, _ in self._ring]  # forget the events
        return orig_buffer(self, nbytes)

    monkeypatch.setattr(DeviceStager, "_buffer", no_wait)
    outs = [stager.stage([[i] * 4], torch.int64)[0] for i in range(3)]
    dev.flush(len(dev.pending))
    assert outs[0].tolist() == [2] * 4  # staging 2 overwrote slot 0 before its copy ran
