"""Routes that extensions add to the server (e.g. /v1/responses): each registers a function
that returns its FastAPI router, and `create_app` mounts every one beside the core's routes.
A function rather than the router, so that loading the extensions (which every process does)
imports no web framework: only a starting server calls it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import APIRouter

_routers: list[Callable[[], APIRouter]] = []


def register_router(router: Callable[[], APIRouter]) -> None:
    _routers.append(router)


def extension_routers() -> list[APIRouter]:
    """Every registered router, the extensions loaded first."""
    from minisgl.extension_loader import load_extensions

    load_extensions()
    return [make() for make in _routers]
