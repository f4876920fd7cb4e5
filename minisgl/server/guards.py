"""ASGI guards in front of every route: API-key authentication and a request-body size limit.

Both are plain ASGI middlewares (not Starlette's BaseHTTPMiddleware, which wraps streaming
responses in a way that hides the client's disconnect). Both answer before the route runs, so
a refused request never reaches the engine.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minisgl.server.errors import error_response
from minisgl.server.observers import Observers

# Orchestrators and load balancers probe these without credentials. SGLang leaves every path
# under /health open, /health_generate included: its one-token greedy generation is no more
# than any probe costs, and probes seldom carry credentials.
OPEN_PATHS = frozenset({"/health", "/health_generate"})
# A refused body is still read (and dropped) up to this multiple of the limit before the 413
# goes out: a client that writes its whole body before reading (urllib, curl) would otherwise
# see the connection reset instead of the answer. Bigger bodies are cut off at once.
DRAIN_FACTOR = 4


def _digest(value: bytes) -> bytes:
    # Comparing fixed-size digests keeps even the key's length out of the timing.
    return hashlib.sha256(value).digest()


class APIKeyGuard:
    """Every route but the health probes requires ``Authorization: Bearer <key>``; otherwise 401."""

    def __init__(self, app: ASGIApp, api_key: str, observers: Observers) -> None:
        self.app = app
        self.expected = _digest(api_key.encode("utf-8"))
        self.observers = observers

    def authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                if scheme.lower() == b"bearer":
                    return hmac.compare_digest(_digest(token.strip()), self.expected)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self.authorized(scope):
            await self.app(scope, receive, send)
            return
        self.observers.on_rejected("unauthorized")
        # Never echo what the client sent: it may be a real key meant for another service.
        response = error_response(
            401,
            "missing or incorrect API key: send it as 'Authorization: Bearer <key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)


class BodySizeLimit:
    """Refuse bodies over ``limit`` bytes with 413, whether the client declared the size
    (Content-Length, refused before reading) or streams it chunked (refused once the limit is
    crossed). The body is read here and handed to the route in one piece; later messages
    (the client's disconnect, which streaming responses watch for) pass through unchanged."""

    def __init__(self, app: ASGIApp, limit: int, observers: Observers) -> None:
        self.app = app
        self.limit = limit
        self.observers = observers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            if int(declared) <= DRAIN_FACTOR * self.limit:
                await _drain(receive, DRAIN_FACTOR * self.limit)
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                if message.get("more_body", False):
                    await _drain(receive, DRAIN_FACTOR * self.limit - size)
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: Message | None = {"type": "http.request", "body": b"".join(chunks)}

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.observers.on_rejected("body_too_large")
        response = error_response(
            413,
            f"the request body is larger than this server's limit of {self.limit} bytes "
            "(--max-request-bytes)",
        )
        await response(scope, receive, send)


async def _drain(receive: Receive, budget: int) -> None:
    """Read and drop the rest of a request body, at most ``budget`` bytes of it."""
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request":
            return
        budget -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return
