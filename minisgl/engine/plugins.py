"""What an extension may add to the engine's startup (a light module: extensions register
here without loading torch).

A memory reserve: memory an extension will put on the device after the engine is built (a
draft model), as (its weight bytes, its KV bytes per page of this engine's pool), given the
configuration and the dtypes of weights and KV; the KV pool is sized to leave room for it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from minisgl.config import EngineConfig

if TYPE_CHECKING:
    import torch

MemoryReserve = Callable[[EngineConfig, "torch.dtype", "torch.dtype"], tuple[int, int]]
_reserves: list[MemoryReserve] = []


def register_memory_reserve(reserve: MemoryReserve) -> None:
    _reserves.append(reserve)


def memory_reserves() -> list[MemoryReserve]:
    return list(_reserves)
