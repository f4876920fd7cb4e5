"""The FastAPI application: routes, error handling, and the IPC frontend's lifetime."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from minisgl.sampling_params import SamplingParams
from minisgl.server import native_api, openai_api
from minisgl.server.errors import (
    APIError,
    ServiceUnavailable,
    error_response,
    install_error_handlers,
)
from minisgl.server.frontend import Frontend
from minisgl.server.guards import APIKeyGuard, BodySizeLimit
from minisgl.server.request_group import make_items
from minisgl.server.routes import extension_routers
from minisgl.server.state import ServerState, server_state

logger = logging.getLogger(__name__)

HEALTH_GENERATE_POLL_S = 0.05
# /health_generate's probe: one greedy token.
PROBE_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)
DEFAULT_MAX_REQUEST_BYTES = 8 << 20


class JSONBodyByDefault:
    """Read POST bodies as JSON when the client did not say what they are: ``curl -d`` sends
    form encoding, and failing such requests as "not an object" only confuses people."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            ctype = dict(scope["headers"]).get(b"content-type", b"")
            if not ctype or ctype.startswith(b"application/x-www-form-urlencoded"):
                scope = dict(scope, headers=[*headers, (b"content-type", b"application/json")])
        await self.app(scope, receive, send)


def create_app(
    state: ServerState,
    on_started: Callable[[], None] | None = None,
    *,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.frontend.start()
        if on_started is not None:
            on_started()
        try:
            yield
        finally:
            await state.frontend.stop()

    app = FastAPI(title="minisgl", lifespan=lifespan)
    observers = state.frontend.observers
    # The last middleware added runs first: authenticate (headers only), then read the body
    # within its size limit, then default its content type.
    app.add_middleware(JSONBodyByDefault)
    app.add_middleware(BodySizeLimit, limit=max_request_bytes, observers=observers)
    if api_key:
        app.add_middleware(APIKeyGuard, api_key=api_key, observers=observers)
    app.state.minisgl = state
    install_error_handlers(app)
    app.include_router(openai_api.router)
    for router in extension_routers():  # e.g. /v1/responses
        app.include_router(router)
    app.include_router(native_api.router)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/health_generate", health_generate, methods=["GET"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"])
    observers.mount(app)  # e.g. /metrics
    return app


def _unhealthy(frontend: Frontend) -> Response | None:
    if frontend.dead_reason is not None:
        return error_response(503, f"unhealthy: {frontend.dead_reason}")
    if frontend.draining:
        return error_response(503, "the server is shutting down")
    stalled = frontend.stalled()
    if stalled is not None:
        return error_response(503, f"unhealthy: {stalled}")
    return None


async def health(request: Request) -> Response:
    """For load balancers, and cheap: a child died, the server is draining, or the scheduler
    left a liveness ping unanswered for longer than --health-timeout (it looks hung): 503."""
    return _unhealthy(server_state(request).frontend) or JSONResponse({"status": "ok"})


async def health_generate(request: Request) -> Response:
    """SGLang's probe through the whole generation path: submit a one-token greedy request
    (prompt: token 0) and answer 200 as soon as any generation output reaches the server
    after it was sent (its own, or, on a busy server, another request's: progress either
    way); 503 if none comes within --health-timeout, or once /health would say 503. The
    probe is aborted if unfinished (freeing its KV) and kept out of the metrics."""
    frontend = server_state(request).frontend
    early = _unhealthy(frontend)
    if early is not None:
        return early
    sent = time.monotonic()
    try:
        group = frontend.submit(make_items([[0]], [PROBE_PARAMS]), probe=True)
    except ServiceUnavailable as exc:
        return error_response(503, f"unhealthy: {exc}")
    try:
        while frontend.last_output_at <= sent:
            failed = _unhealthy(frontend)
            if failed is not None:
                return failed
            if time.monotonic() - sent > frontend.health_timeout:
                return error_response(
                    503,
                    "unhealthy: no generation output within the health timeout "
                    f"({frontend.health_timeout:g}s)",
                )
            await asyncio.sleep(HEALTH_GENERATE_POLL_S)
    finally:
        group.close()
    return JSONResponse({"status": "ok"})


def _model_card(state: ServerState) -> dict[str, object]:
    return {
        "id": state.served_model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "minisgl",
        "root": state.info.model_path,
        "max_model_len": state.info.context_length,
    }


async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(server_state(request))]})


async def retrieve_model(model_id: str, request: Request) -> Response:
    state = server_state(request)
    if model_id != state.served_model_name:
        raise APIError(404, f"the model {model_id!r} does not exist", "model")
    return JSONResponse(_model_card(state))
