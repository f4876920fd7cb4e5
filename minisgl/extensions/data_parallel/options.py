"""The data-parallel server flags, and the checks that turn them into a plan: which GPUs
each replica gets, how many CPU threads, and whether the router is installed."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from minisgl.config import check_fields, option
from minisgl.env import text

# The policies of sglang-router's regular mode (see docs/deployment.md for when to pick each).
POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
VISIBLE_GPUS = text(
    "CUDA_VISIBLE_DEVICES", "the GPUs --dp-size shares out among the replicas", external=True
)


@dataclass(frozen=True)
class DataParallelOptions:
    dp_size: int = option(
        1,
        "engine replicas behind SGLang's router (pip install 'minisgl[router]'): tp-size GPUs "
        "each on CUDA, sharing the cores on CPU",
        "--data-parallel-size",
        low=1,
    )
    router_policy: str = option(
        "cache_aware", f"how the router picks a replica: {' | '.join(POLICIES)}", choices=POLICIES
    )
    router_prometheus_port: int | None = option(
        None, "port of the router's Prometheus metrics (default: a free port, logged)", low=1
    )
    router_args: str | None = option(
        None,
        "more sglang-router flags, as one string (e.g. '--balance-abs-threshold 16'); they win "
        "over the launcher's",
    )

    def __post_init__(self) -> None:
        check_fields(self)


def replica_gpus(dp_size: int, tp_size: int, device: str, visible: list[str]) -> list[str] | None:
    """Each replica's CUDA_VISIBLE_DEVICES (its tp_size GPUs, in order), or None on CPU
    (ValueError when the GPUs do not go round)."""
    if device == "cpu" or (device == "auto" and not visible):
        return None
    if ":" in device:
        raise ValueError(
            f"--device {device} names one GPU, but --dp-size {dp_size} needs one per replica: "
            "pass --device cuda and pick the GPUs with CUDA_VISIBLE_DEVICES"
        )
    need = dp_size * tp_size
    if need > len(visible):
        raise ValueError(
            f"--dp-size {dp_size} x --tp-size {tp_size} needs {need} GPUs, but {len(visible)} "
            "are visible"
        )
    return [",".join(visible[i * tp_size : (i + 1) * tp_size]) for i in range(dp_size)]


def visible_gpus(count: int) -> list[str]:
    """The ids of the GPUs this process sees, as CUDA_VISIBLE_DEVICES spells them."""
    listed = VISIBLE_GPUS.get()
    ids = [g.strip() for g in listed.split(",") if g.strip()] if listed is not None else []
    return ids[:count] if listed is not None else [str(i) for i in range(count)]


def cpu_threads(dp_size: int, tp_size: int, cores: int) -> int:
    # Replicas on one CPU share its cores: oversubscribed threads slow every replica down.
    return max(1, cores // (dp_size * tp_size))


def check_router_installed() -> None:
    if importlib.util.find_spec("sglang_router") is None:
        raise ValueError(
            "--dp-size > 1 runs SGLang's router, which is not installed: "
            "pip install 'minisgl[router]'"
        )
