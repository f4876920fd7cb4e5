"""OpenAI's Responses API, POST /v1/responses (api.py), mounted through the server's route
registry."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minisgl.server.routes import register_router

if TYPE_CHECKING:
    from fastapi import APIRouter


def _router() -> APIRouter:
    from minisgl.extensions.responses.api import router

    return router


register_router(_router)
