"""Where the Triton backend folds q/k norm, RoPE and the K/V store into decode attention
(kernels/decode_fold.py): pure decode steps with ``fused_decode_rope`` on, and nowhere else
(mixed and extend steps keep the fused store kernel). The kernels are replaced by recorders,
so nothing is launched; the engine option reaches the backend.

The folded launch itself is checked against the unfused one, and tiny models' decoding
with the fold on and off, in tests/unit/kernels/test_decode_fold.py.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from minisgl.attention.base import BatchLayout, QKNormRope
from minisgl.kvcache.pool import KVPool

# Not imported here: test_triton_backend.py, collected after this file, sets the
# interpreter up only if no module imported triton before it.
if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

CPU = torch.device("cpu")
HQ, HK, D = 4, 2, 32


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace the kernels the backend calls with recorders; returns the call log."""
    import inspect

    from minisgl.attention import triton_backend
    from minisgl.kernels import qk_rope_store

    calls: list[str] = []
    signature = inspect.signature(triton_backend.decode_attention)

    def decode(*args: object, **kw: object) -> torch.Tensor:
        given = signature.bind(*args, **kw).arguments
        gather = " gather" if given.get("q_index") is not None else ""
        calls.append("decode" + gather + (" fold" if given.get("fold") is not None else ""))
        q = given["q"]
        assert isinstance(q, torch.Tensor)
        return q.new_zeros(q.shape[0], HQ * D)

    def extend(q: torch.Tensor, *args: object, **kw: object) -> torch.Tensor:
        calls.append("extend")
        return q.new_zeros(q.shape[0], HQ * D)

    def store(q: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append("store")
        return q.clone()

    monkeypatch.setattr(triton_backend, "decode_attention", decode)
    monkeypatch.setattr(triton_backend, "extend_attention", extend)
    monkeypatch.setattr(qk_rope_store, "fused_qk_norm_rope_store", store)
    return calls


def _step(fold: bool, prefix: list[int], ext: list[int], norm: bool = True) -> None:
    from minisgl.attention.triton_backend import TritonBackend

    pool = KVPool(1, 64, 1, HK, D, torch.float32, CPU)
    backend = TritonBackend(pool, fused_kv_store=True, fused_decode_rope=fold)
    rows = list(range(len(prefix)))
    layout = BatchLayout(rows, prefix, ext, torch.arange(4 * 16).view(4, 16))
    md = backend.prepare(layout, CPU)
    t = sum(ext)
    qkv = torch.randn(t, (HQ + 2 * HK) * D)
    q, k, v = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
    q, k, v = q.view(t, HQ, D), k.view(t, HK, D), v.view(t, HK, D)
    w = torch.ones(D) if norm else None
    rope = QKNormRope(torch.zeros(t, dtype=torch.long), torch.ones(8, D), torch.zeros(8, D), w, w)
    out = backend.forward_norm_rope(q, k, v, rope, 0, torch.arange(t), md, D**-0.5)
    assert out.shape == (t, HQ * D)


def test_pure_decode_steps_fold(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _recording(monkeypatch)
    _step(True, [5, 30], [1, 1])
    _step(True, [7], [1], norm=False)  # a model without q/k norm: RoPE and the store
    assert calls == ["decode fold", "decode fold"]


def test_other_steps_keep_the_fused_store(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _recording(monkeypatch)
    _step(True, [0, 30], [6, 1])  # mixed: a prefill chunk beside a decode row
    assert calls == ["store", "extend", "decode gather"]
    calls.clear()
    _step(True, [3], [4])  # extend only
    assert calls == ["store", "extend"]
    calls.clear()
    _step(False, [5, 30], [1, 1])  # the option off
    assert calls == ["store", "decode"]


def test_engine_option_reaches_the_backend() -> None:
    """Engine._make_backend on a stand-in engine (no model): the option folds only where the
    fused store runs (CUDA, not disabled)."""
    from minisgl.attention.triton_backend import TritonBackend
    from minisgl.config import EngineConfig
    from minisgl.engine.engine import Engine
    from minisgl.kernels.staging import DeviceStager

    pool = KVPool(1, 8, 1, HK, D, torch.float32, CPU)
    for device, disable, want in (("cuda", False, True), ("cuda", True, False), ("cpu", False, False)):  # fmt: skip
        for option in (True, False):
            config = EngineConfig(attention_backend="triton", disable_fused_decode_rope=not option,
                                  disable_fused_rope_store=disable)  # fmt: skip
            engine = SimpleNamespace(
                device=torch.device(device), config=config, pool=pool, stager=DeviceStager(CPU)
            )
            backend = Engine._make_backend(engine)  # type: ignore[arg-type]
            assert isinstance(backend, TritonBackend)
            assert backend.fused_kv_store == (device == "cuda" and not disable)
            assert backend.fused_decode_rope == (want and option)
