"""Which weights are asked into L2 ahead of their product in small decode batches
(kernels/prefetch.py), and when.

Sites, each named after the weight it fetches and issued just before a stretch of kernels that
leave the memory bus idle:
- ``o``: o_proj's weight, after the q/k/v product (RoPE and attention run meanwhile);
- ``up``: gate_up_proj's weight, after o_proj's product (its all-reduce and the norm);
- ``qkv``: the next layer's qkv_proj weight, after down_proj's product (likewise).

MINISGL_L2_PREFETCH lists the sites, each with an optional cap in MiB (``site:MiB``: a window
of a few microseconds fills only part of L2 in time), or ``all`` / ``0``. Prefetching writes
nothing, so outputs are identical with any setting.
"""

from __future__ import annotations

import functools
import os

import torch

DEFAULT_SITES = "0"
# Token rows up to which a batch is a "small decode batch" that streams its weights.
MAX_ROWS = int(os.environ.get("MINISGL_L2_PREFETCH_MAX_ROWS", "16"))


def parse_sites(spec: str) -> dict[str, int | None]:
    """``"o,up:24"`` -> {"o": None, "up": 24 MiB in bytes}; ``all``; ``0``/``off``: none."""
    spec = spec.strip().lower()
    if spec in ("", "0", "off", "false", "no"):
        return {}
    if spec == "all":
        spec = "o,up,qkv"
    sites: dict[str, int | None] = {}
    for item in spec.split(","):
        name, _, cap = item.strip().partition(":")
        if name not in ("o", "up", "qkv"):
            raise ValueError(f"MINISGL_L2_PREFETCH: unknown site {name!r} (o, up, qkv)")
        sites[name] = int(float(cap) * 2**20) if cap else None
    return sites


SITES = parse_sites(os.environ.get("MINISGL_L2_PREFETCH", DEFAULT_SITES))


@functools.cache
def _supported(device: torch.device) -> bool:
    # The bulk prefetch is an sm_90 instruction, and inline PTX has no interpreter.
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def prefetch(site: str, weight: torch.Tensor | None, rows: int) -> None:
    """Prefetch ``weight`` into L2 if ``site`` is on and the batch is small."""
    if weight is None or site not in SITES or rows > MAX_ROWS or not weight.is_cuda:
        return
    if not _supported(weight.device):
        return
    from minisgl.kernels.prefetch import prefetch_l2

    prefetch_l2(weight, SITES[site])
