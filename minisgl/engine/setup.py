"""What the engine does once, at startup: pick the device and dtypes, read the model's
configuration, load its weights, and size the KV pool from the memory left."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from minisgl.config import EngineConfig
from minisgl.distributed import TPInfo
from minisgl.engine.plugins import memory_reserves
from minisgl.kvcache.kv_scales import KVScales
from minisgl.kvcache.pool import KVPool
from minisgl.models.config import ModelConfig
from minisgl.models.loader import iter_dummy_weights, iter_safetensors, load_weights
from minisgl.models.resolve import ResolvedModel

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HFConfig = dict[str, object]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build modules in ``dtype`` (their parameters are created in the default dtype)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def model_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def read_hf_config(resolved: ResolvedModel) -> HFConfig:
    if resolved.kind == "gguf":
        from minisgl.models.gguf_loader import gguf_hf_config

        return dict(gguf_hf_config(resolved.path))
    cfg: HFConfig = json.loads((resolved.path / "config.json").read_text())
    gen = resolved.path / "generation_config.json"
    if gen.exists():
        # Instruct models list their end-of-turn ids here; HF generate stops on them too.
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            cfg["eos_token_id"] = eos
    return cfg


def load_model_weights(
    model: nn.Module,
    config: EngineConfig,
    resolved: ResolvedModel,
    hf_config: HFConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> KVScales:
    """Load the weights; the KV-cache scales a safetensors checkpoint holds come back
    (kvcache/kv_scales.py: an fp8 cache uses them)."""
    scales = KVScales()
    if config.load_format == "dummy":
        # One full random checkpoint, of which every TP rank loads its shard.
        load_weights(model, iter_dummy_weights(dict(hf_config), device, dtype, config.seed))
    elif resolved.kind == "gguf":
        from minisgl.models.gguf_loader import iter_gguf_weights, release_readers

        raw = hf_config.get("quantization_config") is not None  # kept quantized (gguf method)
        load_weights(model, iter_gguf_weights(resolved.path, dtype, raw))
        # The file's parsed header (vocabulary strings) and the loading temporaries are no
        # longer needed here: a few hundred MB for the bundled model until given back.
        release_readers()
        trim_heap()
    else:
        load_weights(model, scales.take(iter_safetensors(Path(resolved.path), device)))
    return scales


def kv_pool_pages(
    config: EngineConfig,
    cfg: ModelConfig,
    kv_heads: int,
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    max_pages: int,
) -> int:
    """How many pages the KV pool gets: ``config.num_pages``, else what the memory budget
    holds beside the weights and any extension's reserve, at most ``max_pages``."""
    if config.num_pages is not None:
        return config.num_pages
    per_page = KVPool.bytes_per_page(
        cfg.num_layers, config.page_size, kv_heads, cfg.head_dim, kv_dtype
    )
    reserved_weights = 0
    for reserve in memory_reserves():
        weights, page = reserve(config, dtype, kv_dtype)
        reserved_weights, per_page = reserved_weights + weights, per_page + page
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * config.mem_fraction_static) - used - reserved_weights
        short = (
            f"{used / 2**30:.1f} of {total / 2**30:.1f} GiB of {device} are in use (weights, or "
            f"another process or engine) and mem_fraction_static={config.mem_fraction_static} "
            "caps the total: free that memory or raise it"
        )
    else:
        budget = int(config.cpu_kv_cache_gb * (1 << 30))
        short = f"cpu_kv_cache_gb={config.cpu_kv_cache_gb} is too small: raise it"
    if budget < 2 * per_page:
        # Else the pool shrinks to its 2-page minimum and every prompt is "too long" for a
        # context of one page: fail at startup, saying why.
        raise ValueError(
            f"no memory left for the KV cache ({max(budget, 0) / 2**20:.1f} MiB, need at "
            f"least {2 * per_page / 2**20:.2f}): {short}"
        )
    return max(2, min(budget // per_page, max_pages))


def agree_on_pages(num_pages: int, tp: TPInfo, device: torch.device) -> int:
    """The smallest page count of every TP rank (collective): the ranks must schedule alike."""
    if tp.size == 1:
        return num_pages
    t = torch.tensor([num_pages], device=device if device.type == "cuda" else "cpu")
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return int(t.item())


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # type: ignore[no-any-return]  # glibc
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """Give the C heap's free memory back to the OS, once idle after work. Bursts of large
    temporaries (long prefills, prompt-logprob logits on CPU) would otherwise keep the
    process at its high-water mark for good: glibc returns little of it by itself."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
