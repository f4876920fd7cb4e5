"""HiCache's options (flags ``--hicache-*``, keywords of ``LLM``) and their startup checks."""

from __future__ import annotations

import os
from dataclasses import dataclass

from minisgl.config import EngineConfig, option

# The backends whose reads wait for each layer's load (the layers call KVPool.wait_layer
# before attending). FlashInfer plans its paged reads ahead of the layers and is not
# validated with loads landing layer by layer: refused rather than risked.
BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class HiCacheOptions:
    hicache_size: float = option(
        0.0,
        "HiCache: GiB of host memory for a second KV-cache tier below the device pool, all TP "
        "ranks together (0: off)",
        low=0,
    )
    hicache_write_policy: str = option(
        "write_back",
        "HiCache: write_back (save a prefix to the host when the device evicts it) | "
        "write_through (also when it is first cached)",
        choices=("write_back", "write_through"),
    )


def available_host_bytes() -> int:
    """Memory the host can still give (MemAvailable), or its whole memory where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check(config: EngineConfig) -> None:
    o = config.ext(HiCacheOptions)
    if o.hicache_size <= 0:
        return
    avail = available_host_bytes()
    rules = [
        (o.hicache_size * 2**30 <= avail, f"at most the host's available {avail / 2**30:.1f} GiB"),
        (config.cache == "radix", "needs cache='radix' (a second tier below the prefix cache)"),
        (
            config.attention_backend in BACKENDS,
            f"not supported with attention_backend={config.attention_backend!r} "
            f"(one of {', '.join(BACKENDS)})",
        ),
    ]
    for ok, want in rules:
        if not ok:
            raise ValueError(f"hicache_size={o.hicache_size!r} is invalid: {want}")
