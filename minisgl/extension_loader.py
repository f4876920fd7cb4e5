"""The one place extensions are loaded.

Every package under ``minisgl/extensions/`` is an extension. Importing it registers what it
adds with the registries the core defines (options, attention backends, quantization
methods, reducers, speculators, sampling constraints, API routes); nothing else in minisgl
imports an extension by name. A package that is not there is simply not loaded, and the
core runs without it: its options are then unknown, its features refused.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil

logger = logging.getLogger(__name__)

_loaded: list[str] | None = None
_unavailable: dict[str, str] = {}  # extension -> why it could not be imported


def load_extensions() -> None:
    """Import every extension package once (idempotent; each process calls it on its own:
    spawned children do, through the entry points that need the registries)."""
    global _loaded
    if _loaded is not None:
        return
    _loaded = []
    try:
        package = importlib.import_module("minisgl.extensions")
    except ModuleNotFoundError:
        return
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if not info.ispkg:
            continue
        try:
            importlib.import_module(f"minisgl.extensions.{info.name}")
        except ImportError as exc:  # e.g. made unimportable, or broken: run without it
            _unavailable[info.name] = str(exc)
            logger.warning("extension %s is not loaded: %s", info.name, exc)
            continue
        _loaded.append(info.name)


def loaded_extensions() -> list[str]:
    load_extensions()
    return list(_loaded or [])
