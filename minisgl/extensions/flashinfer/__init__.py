"""FlashInfer attention (``--attention-backend flashinfer``): a backend over the optional
``flashinfer-python`` package (CUDA, bf16/fp16, run eagerly; backend.py), registered by name
with minisgl/attention/registry.py.

It adds no options, only a check of the configuration: FlashInfer reads a 16-bit KV cache,
so an fp8 ``--kv-cache-dtype`` is refused when the configuration is built (the backend
refuses an fp8 pool too, for engines configured by hand).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from minisgl.attention.registry import register_backend
from minisgl.config import EngineConfig, OptionGroup, register_options

if TYPE_CHECKING:
    import torch

    from minisgl.attention.base import AttentionBackend
    from minisgl.kernels.staging import DeviceStager
    from minisgl.kvcache.pool import KVPool

NAME = "flashinfer"


@dataclass(frozen=True)
class FlashInferOptions:
    """None of its own: the group carries `check`."""


def check(config: EngineConfig) -> None:
    if config.attention_backend == NAME and config.kv_cache_dtype != "auto":
        raise ValueError(
            f"kv_cache_dtype={config.kv_cache_dtype!r} is invalid: the flashinfer attention "
            "backend supports only auto: use attention_backend triton or torch with an fp8 "
            "KV cache"
        )


def make_backend(
    pool: KVPool,
    device: torch.device,
    stager: DeviceStager,
    fused_kv_store: bool,
    fused_decode_rope: bool,
) -> AttentionBackend:
    from minisgl.extensions.flashinfer.backend import FlashInferBackend

    return FlashInferBackend(pool, device)


register_backend(NAME, make_backend)
register_options(OptionGroup("flashinfer attention", FlashInferOptions, check))
