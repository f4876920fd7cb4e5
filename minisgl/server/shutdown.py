"""Graceful shutdown: the first SIGTERM drains the server instead of cutting requests off.

Draining: new generation requests get 503 (with Retry-After) and /health turns 503 so load
balancers stop routing here, while admitted requests run to completion, for at most
``--shutdown-timeout`` seconds. Whatever is still running then is aborted (its KV freed) and
its client is told so: an HTTP 503, or an error event on an open stream. Only then does
uvicorn stop; the launcher stops the child processes after it.

Ctrl-C (SIGINT) drains with no grace period: running requests are aborted at once, but their
clients still get a proper answer. A second signal of either kind stops the server right away.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn

from minisgl.server.frontend import Frontend

logger = logging.getLogger("minisgl.server")

SHUTDOWN_MESSAGE = "the server is shutting down; the request was aborted before it finished"


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, frontend: Frontend, shutdown_timeout: float):
        super().__init__(config)
        self.frontend = frontend
        self.shutdown_timeout = shutdown_timeout
        self.drain_task: asyncio.Task[None] | None = None
        self.drain_started = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs as a signal handler on the event loop's thread, possibly in the middle of the
        # loop's own code: only hand work to the loop through its thread-safe entry point.
        loop = self.frontend.loop
        if loop is None or self.drain_started or self.should_exit:
            # Not serving yet, or a second signal: stop now (uvicorn's own behaviour), but
            # still tell the clients of running requests why their answer ends.
            if loop is not None:
                loop.call_soon_threadsafe(self.frontend.abort_all, SHUTDOWN_MESSAGE, 503)
            super().handle_exit(sig, frame)
            return
        # uvicorn re-raises the captured signals once it has stopped; the launcher turns
        # that into a clean exit.
        self._captured_signals.append(sig)
        self.drain_started = True
        grace = self.shutdown_timeout if sig == signal.SIGTERM else 0.0
        loop.call_soon_threadsafe(self._start_drain, grace)

    def _start_drain(self, grace: float) -> None:
        self.drain_task = asyncio.get_running_loop().create_task(self.drain(grace))

    async def drain(self, grace: float) -> None:
        frontend = self.frontend
        frontend.start_draining()
        live = frontend.num_live_requests
        logger.info(
            "shutting down: refusing new requests, letting %d running sequence(s) finish "
            "(up to %gs)",
            live,
            grace,
        )
        try:
            if not await frontend.wait_drained(grace):
                n = frontend.abort_all(SHUTDOWN_MESSAGE, 503)
                frontend.observers.on_aborted("shutdown", n)
                logger.warning("aborted %d sequence(s) still running after %gs", n, grace)
        finally:
            # uvicorn now stops listening and waits (briefly) for open responses to be sent.
            self.should_exit = True
