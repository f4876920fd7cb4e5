"""The programmatic-dependent-launch switch (kernels/pdl.py): on only where the GPU has
grid-dependency control, off with the PDL switch off and under Triton's interpreter. Its effect
on outputs (none) is checked on the GPU: tests/gpu/test_gpu_engine.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from minisgl import env
from minisgl.kernels import pdl


@pytest.fixture(autouse=True)
def fresh_cache() -> Iterator[None]:
    pdl.pdl_enabled.cache_clear()
    yield
    pdl.pdl_enabled.cache_clear()


@pytest.fixture
def defaults() -> Iterator[None]:
    with env.override({env.TRITON_INTERPRET: None, env.PDL: True}):
        yield


def test_off_without_a_hopper_gpu(monkeypatch: pytest.MonkeyPatch, defaults: None) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pdl.pdl_enabled() is False
    assert pdl.pdl_args() == {"PDL": False, "launch_pdl": False}


def test_on_for_capability_9(monkeypatch: pytest.MonkeyPatch, defaults: None) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert pdl.pdl_args() == {"PDL": True, "launch_pdl": True}
    pdl.pdl_enabled.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert pdl.pdl_enabled() is False  # Ampere has no griddepcontrol


@pytest.mark.parametrize("switch", ["pdl", "interpreter"])
def test_switched_off(monkeypatch: pytest.MonkeyPatch, defaults: None, switch: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    off = {env.PDL: False} if switch == "pdl" else {env.TRITON_INTERPRET: "1"}
    with env.override(off):
        assert pdl.pdl_enabled() is False
