"""The FlashInfer extension (minisgl/extensions/flashinfer; runs without flashinfer): the
paged-KV indices gathered on the device equal a row-by-row walk of the page table; asking
for the backend without the package (or off CUDA) is a clear error, and so is an fp8 KV
cache with it. The kernels themselves are checked on the GPU
(tests/gpu/test_flashinfer_gpu.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from minisgl import LLM
from minisgl.attention.base import BatchLayout
from minisgl.attention.registry import backend_names
from minisgl.config import EngineConfig
from minisgl.extensions.flashinfer.backend import paged_indices


def test_paged_indices_walk_the_page_table() -> None:
    g = torch.Generator().manual_seed(3)
    table = torch.randint(0, 10_000, (6, 40), generator=g)
    rows, prefix, ext = [4, 0, 2, 5], [7, 0, 30, 3], [1, 12, 1, 5]
    p = paged_indices(BatchLayout(rows, prefix, ext, table), torch.device("cpu"))
    seq = [a + b for a, b in zip(prefix, ext)]
    assert p.qo_indptr.tolist() == [0, 1, 13, 14, 19]
    assert p.kv_indptr.tolist() == [0, 8, 20, 51, 59]
    want = [int(s) for r, n in zip(rows, seq) for s in table[r, :n]]
    assert p.kv_indices.tolist() == want and p.kv_indices.dtype == torch.int32
    assert p.last_page_len.tolist() == [1, 1, 1, 1]
    for t in (p.qo_indptr, p.kv_indptr, p.last_page_len):
        assert t.dtype == torch.int32 and t.device.type == "cpu"  # planned on the host


@pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is not None, reason="flashinfer is installed"
)
def test_flashinfer_without_the_package_is_a_clear_error(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="pip install flashinfer-python"):
        LLM(str(tiny_models["qwen3"]), attention_backend="flashinfer")


def test_registered_by_name() -> None:
    assert backend_names()[:2] == ["torch", "triton"] and "flashinfer" in backend_names()


def test_flashinfer_refuses_fp8_at_startup() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'.*flashinfer"):
        EngineConfig.from_kwargs(kv_cache_dtype="fp8", attention_backend="flashinfer")
    EngineConfig.from_kwargs(kv_cache_dtype="auto", attention_backend="flashinfer")  # fine
    EngineConfig.from_kwargs(kv_cache_dtype="fp8", attention_backend="triton")  # fine


def test_plan_waits_for_the_previous_plans_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Upstream #103: plan() reuses a pinned host buffer whose copy to the device may still be
    queued (overlap scheduling plans batch N+1 before batch N runs). Each wrapper's plan must
    wait for the event recorded after its previous plan; decode and prefill wrappers have
    buffers of their own, so one never waits on the other's. (Fakes stand in for flashinfer
    and CUDA events, so this runs on CPU.)"""
    from minisgl.extensions.flashinfer import backend as fb
    from minisgl.kvcache.pool import KVPool

    log: list[str] = []

    class FakeEvent:
        count = 0

        def __init__(self) -> None:
            FakeEvent.count += 1
            self.name = f"e{FakeEvent.count}"

        def record(self) -> None:
            log.append(f"record {self.name}")

        def synchronize(self) -> None:
            log.append(f"wait {self.name}")

    class FakeWrapper:
        def __init__(self, kind: str) -> None:
            self.kind = kind

        def plan(self, *args: object, **kwargs: object) -> None:
            log.append(f"plan {self.kind}")

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    backend = object.__new__(fb.FlashInferBackend)
    backend.pool = KVPool(1, 16, 1, 2, 64, torch.float16, torch.device("cpu"))
    backend._decode, backend._prefill = FakeWrapper("decode"), FakeWrapper("prefill")
    backend._plan_copied = {}
    table = torch.arange(32).view(2, 16)
    decode = BatchLayout([0, 1], [3, 4], [1, 1], table)
    prefill = BatchLayout([0], [0], [5], table)
    for layout in (decode, prefill, decode, decode, prefill):
        md = backend.prepare(layout, torch.device("cpu"))
        backend._plan(md, 4, 0.125)
        assert md.planned
    assert log == [
        "plan decode", "record e1",
        "plan prefill", "record e2",
        "wait e1", "plan decode", "record e3",
        "wait e3", "plan decode", "record e4",
        "wait e2", "plan prefill", "record e5",
    ]  # fmt: skip
