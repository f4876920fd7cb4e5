"""MINISGL_L2_PREFETCH's parsing (layers/prefetch.py); the prefetch itself is checked on the
GPU (tests/gpu/test_gpu_engine.py: tokens unchanged with every site on)."""

from __future__ import annotations

import pytest
import torch

from minisgl.layers import prefetch


def test_sites_parse_with_caps() -> None:
    assert (
        prefetch.parse_sites("0") == {} == prefetch.parse_sites("off") == prefetch.parse_sites("")
    )
    assert prefetch.parse_sites("all") == {"o": None, "up": None, "qkv": None}
    assert prefetch.parse_sites(" o, up:24 ,qkv:0.5") == {
        "o": None,
        "up": 24 * 2**20,
        "qkv": 2**19,
    }
    with pytest.raises(ValueError, match="unknown site 'down'"):
        prefetch.parse_sites("o,down")


def test_cpu_tensors_and_big_batches_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from minisgl.kernels import prefetch as kernels

    def fail(*args: object) -> None:
        raise AssertionError("prefetched")

    monkeypatch.setattr(kernels, "prefetch_l2", fail)
    monkeypatch.setattr(prefetch, "SITES", prefetch.parse_sites("all"))
    prefetch.prefetch("o", torch.zeros(4, 4), 1)  # not on a GPU
    prefetch.prefetch("o", None, 1)
    if torch.cuda.is_available():
        prefetch.prefetch("o", torch.zeros(4, 4, device="cuda"), prefetch.MAX_ROWS + 1)
