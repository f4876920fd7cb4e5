"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
    504: "timeout_error",
}

# Every 503 means "try again shortly" (queue full, shutting down, engine restarting): say when,
# so that clients and proxies back off instead of hammering an overloaded server.
RETRY_AFTER_S = 1


class ServiceUnavailable(RuntimeError):
    """The engine is gone (a child process died) or the server is shutting down."""


class Draining(ServiceUnavailable):
    """The server is shutting down gracefully: running requests finish, new ones are refused."""


class ClientGone(Exception):
    """The HTTP client disconnected before its response was complete."""


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


_FIELD_RE = re.compile(r"^(\w+) (must|requires)")


def param_of(message: str) -> str | None:
    """The field a validation message names (messages start with the field name)."""
    m = _FIELD_RE.match(message)
    return m.group(1) if m else None


def bad_request(exc: Exception | str) -> APIError:
    message = str(exc)
    return APIError(400, message, param_of(message))


def engine_error(status: int, message: str) -> APIError:
    """An error the scheduler reported for a request (status 0: unknown, 500); a 400 names
    its field like the API server's own validation errors."""
    status = status or 500
    return APIError(status, message, param_of(message) if status == 400 else None)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, object]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "param": param,
            "code": status,
        }
    }


def error_response(
    status: int, message: str, param: str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    headers = dict(headers or {})
    if status == 503:
        headers.setdefault("Retry-After", str(RETRY_AFTER_S))
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def sse_error(status: int, message: str) -> str:
    return f"data: {json.dumps(error_body(status, message))}\n\n"


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    where = ".".join(loc) if loc else "body"
    return f"{where}: {first.get('msg', 'invalid value')}", (loc[0] if loc else None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    # FastAPI answers schema violations with 422; OpenAI clients expect 400.
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {exc}")
