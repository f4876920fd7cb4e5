"""Host-to-device staging and the Triton metadata a CUDA graph replays."""

from __future__ import annotations

import numpy as np
import torch

from minisgl.attention.base import BatchLayout
from minisgl.attention.triton_backend import TritonBackend
from minisgl.engine.staging import DeviceStager
from minisgl.kvcache.pool import KVPool


def test_segments_are_aligned_and_exact() -> None:
    stager = DeviceStager(torch.device("cpu"))
    segments = [[1, 2, 3], np.arange(5), torch.tensor([7]), [], (9, 10)]
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


def test_copy_metadata_refreshes_every_field() -> None:
    """A captured graph reads the views of its metadata's buffer: copying a fresh batch's
    metadata in must update every field, made under inference mode as the engine does."""
    pool = KVPool(1, 64, 1, 2, 16, torch.float32, torch.device("cpu"))
    table = torch.zeros(8, 64, dtype=torch.int64)
    backend = TritonBackend(pool, stager=DeviceStager(torch.device("cpu")), num_sms=4)
    with torch.inference_mode():
        captured = backend.prepare(_layout(table, [7, 7, 7], [1, 1, 1]), torch.device("cpu"))
        fresh = backend.prepare(_layout(table, [0, 3, 5], [40, 9, 600]), torch.device("cpu"))
        backend.copy_metadata(captured, fresh)
    for name in ("row_ids", "prefix_lens", "extend_lens", "seq_lens", "num_splits"):
        assert getattr(captured, name).tolist() == getattr(fresh, name).tolist(), name
    assert captured.seq_lens.tolist() == [40, 9, 600]
