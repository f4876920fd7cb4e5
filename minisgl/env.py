"""Every environment variable minisgl reads, declared and read here and nowhere else.

A switch is declared once (``flag``, ``number`` or ``text``) with its default and what it
does; its value is read from the environment the first time it is asked for and kept, so a
process sees one value for its whole life. Extensions declare theirs through the same
functions. On/off switches take one convention: ``1``/``true``/``yes``/``on`` or
``0``/``false``/``no``/``off`` (any case); anything else is an error naming the variable.

Tests change a switch with ``override`` (this process) or ``child_environ`` (processes it
starts), never by writing ``os.environ`` themselves. docs/options.md lists every switch;
a test keeps that table and this registry in step.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
V = TypeVar("V", covariant=True)  # a Switch[bool] is a Switch[object]
PREFIX = "MINISGL_"
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Switch(Generic[V]):
    env_name: str  # the variable, e.g. MINISGL_PDL
    default: V
    doc: str
    parse: Callable[[str], V]

    def get(self) -> V:
        """The value, read from the environment on first use and kept."""
        if self.env_name not in _values:
            raw = os.environ.get(self.env_name, "").strip()
            _values[self.env_name] = self.parse(raw) if raw else self.default
        return _values[self.env_name]  # type: ignore[return-value]


_registry: dict[str, Switch[object]] = {}
_values: dict[str, object] = {}
_UNSET = object()


def _register(switch: Switch[T]) -> Switch[T]:
    if switch.env_name in _registry:
        raise ValueError(f"environment switch {switch.env_name} is declared twice")
    _registry[switch.env_name] = switch
    return switch


def _parse_flag(name: str) -> Callable[[str], bool]:
    def parse(raw: str) -> bool:
        if raw.lower() in _ON:
            return True
        if raw.lower() in _OFF:
            return False
        raise ValueError(f"{name}={raw!r} is invalid: one of {', '.join(_ON + _OFF)}")

    return parse


def _parse_number(name: str) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is invalid: a number") from None

    return parse


def flag(name: str, default: bool, doc: str) -> Switch[bool]:
    """An on/off switch ``MINISGL_<name>``."""
    env_name = PREFIX + name
    return _register(Switch(env_name, default, doc, _parse_flag(env_name)))


def number(name: str, default: float, doc: str) -> Switch[float]:
    env_name = PREFIX + name
    return _register(Switch(env_name, default, doc, _parse_number(env_name)))


def text(name: str, doc: str, external: bool = False) -> Switch[str | None]:
    """A string, None when unset; ``external``: a variable of another program, read as is."""
    env_name = name if external else PREFIX + name
    return _register(Switch(env_name, None, doc, lambda raw: raw))


def registered() -> list[Switch[object]]:
    return sorted(_registry.values(), key=lambda s: s.env_name)


@contextlib.contextmanager
def override(values: dict[Switch[object], object]) -> Iterator[None]:
    """Give switches these values for the duration (tests): in this process, and in the
    environment that processes it starts inherit (spawned TP ranks, servers)."""
    saved = {
        s.env_name: (_values.get(s.env_name, _UNSET), os.environ.get(s.env_name)) for s in values
    }
    try:
        for switch, value in values.items():
            _values[switch.env_name] = value
            if value is None:
                os.environ.pop(switch.env_name, None)
            else:
                os.environ[switch.env_name] = _spell(value)
        yield
    finally:
        for name, (value, raw) in saved.items():
            if value is _UNSET:
                _values.pop(name, None)
            else:
                _values[name] = value
            if raw is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = raw


def child_environ(values: dict[Switch[object], object]) -> dict[str, str]:
    """This process's environment with these switches set, for a process it starts."""
    env = dict(os.environ)
    for switch, value in values.items():
        env[switch.env_name] = _spell(value)
    return env


def export(values: dict[str, str]) -> None:
    """Set variables of other programs (CUDA's device list, OpenMP's threads) in this
    process's environment, for the libraries it loads next and the processes it starts."""
    os.environ.update(values)


def _spell(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


# ---------------------------------------------------------------- the core's switches
API_KEY = text("API_KEY", "the API key the server requires when --api-key is not given")
CACHE_DIR = text("CACHE_DIR", "where the bundled model is cached (default: XDG cache dir)")
XDG_CACHE_HOME = text("XDG_CACHE_HOME", "the XDG cache directory", external=True)
DIST_TIMEOUT_S = number(
    "DIST_TIMEOUT_S",
    600.0,
    "seconds a TP collective or the rendezvous may wait before the run fails",
)
PDL = flag("PDL", True, "programmatic dependent launch of Triton kernels (Hopper)")
TRITON_INTERPRET = text("TRITON_INTERPRET", "Triton's CPU interpreter (tests)", external=True)
CPU_KERNELS = flag(
    "CPU_KERNELS", True, "CPU: fused C kernels for add+RMSNorm, RoPE and decode attention"
)
CPU_STACK = flag(
    "CPU_STACK", True, "CPU: a decode step's decoder layers in one C call (packed GGUF weights)"
)
CPU_TILE_ROWS = number(
    "CPU_TILE_ROWS",
    12,
    "CPU, AVX-512: quantized products of this many rows or more multiply float32 weight tiles "
    "dequantized into L1 (csrc/cpu_tile.c); 0: the integer kernels for every row count",
)
CPU_ONEDNN = flag("CPU_ONEDNN", True, "CPU: linear weights reordered once for oneDNN")
FP8_KV_MODE = number(
    "FP8_KV_MODE",
    0,
    "CUDA, fp8 KV cache, 16-bit model: how attention converts fp8 tiles (kernels/fp8_kv.py): "
    "0 upcast to the model dtype (alternatives, slower on an H100: 1 cvt, 2 / 3 bit moves)",
)
TRITON_GEMV = flag("TRITON_GEMV", True, "CUDA batch 1: Triton GEMV where it beats cuBLAS")
