"""Attention backends by name: ``--attention-backend NAME`` builds the one registered as NAME.

The core registers ``torch`` (the reference; the CPU default) and ``triton`` (the CUDA
default); extensions register more when they are loaded (minisgl/extensions/flashinfer).
A factory gets what a backend may need and builds it, raising ValueError (naming the field)
where it cannot run: its package missing, the wrong device or dtype.

Nothing here imports torch: extensions register from their ``__init__``, which processes
that never compute (the API server) import too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from minisgl.extension_loader import load_extensions

if TYPE_CHECKING:
    import torch

    from minisgl.attention.base import AttentionBackend
    from minisgl.kernels.staging import DeviceStager
    from minisgl.kvcache.pool import KVPool


class BackendFactory(Protocol):
    def __call__(
        self,
        pool: KVPool,
        device: torch.device,
        stager: DeviceStager,
        fused_kv_store: bool,
        fused_decode_rope: bool,
    ) -> AttentionBackend:
        """``fused_kv_store``: the layers may store K/V themselves, fused with q/k norm and
        RoPE (AttentionBackend.fused_kv_store); a backend without ``attend`` ignores it.
        ``fused_decode_rope`` (with it): a backend may fold that work into its decode
        attention (on unless the engine's ``disable_fused_decode_rope``); others ignore it."""
        ...


_factories: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    _factories[name] = factory


def backend_names() -> list[str]:
    """Every registered name, extensions loaded first."""
    load_extensions()
    return list(_factories)


def make_backend(
    name: str,
    pool: KVPool,
    device: torch.device,
    stager: DeviceStager,
    fused_kv_store: bool,
    fused_decode_rope: bool,
) -> AttentionBackend:
    """The backend ``name`` ("auto": triton on CUDA, torch elsewhere) over ``pool``."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    factory = _factories.get(name) if name in backend_names() else None
    if factory is None:
        raise ValueError(
            f"attention_backend={name!r} is invalid: auto or a registered backend "
            f"({', '.join(backend_names())})"
        )
    return factory(pool, device, stager, fused_kv_store, fused_decode_rope)


def _torch(
    pool: KVPool,
    device: torch.device,
    stager: DeviceStager,
    fused_kv_store: bool,
    fused_decode_rope: bool,
) -> AttentionBackend:
    from minisgl.attention.torch_backend import TorchBackend

    return TorchBackend(pool)


def _triton(
    pool: KVPool,
    device: torch.device,
    stager: DeviceStager,
    fused_kv_store: bool,
    fused_decode_rope: bool,
) -> AttentionBackend:
    from minisgl.attention.triton_backend import TritonBackend

    return TritonBackend(
        pool, stager=stager, fused_kv_store=fused_kv_store, fused_decode_rope=fused_decode_rope
    )


register_backend("torch", _torch)
register_backend("triton", _triton)
