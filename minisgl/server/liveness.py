"""Liveness: the scheduler answers a "ping" control message from its loop, between steps. A
ping unanswered for the health timeout makes /health 503. The default is generous because
one step can legitimately block the loop for long: a huge prefill, or the first use of a
kernel shape compiling (Triton JIT) on a GPU; a load balancer that pulls a busy but working
server out of rotation does more harm than one that notices a hang late."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from minisgl.server.errors import ServiceUnavailable

DEFAULT_HEALTH_TIMEOUT_S = 60.0
PING_INTERVAL_S = 5.0  # at most; a quarter of the timeout when that is shorter


class Heartbeat:
    """``ping(timeout)`` sends a ping (through the tokenizer worker: the whole request path)
    and waits for its answer."""

    def __init__(self, ping: Callable[[float], Awaitable[object]], health_timeout: float) -> None:
        self.ping = ping
        self.health_timeout = health_timeout
        self.ping_interval = min(PING_INTERVAL_S, health_timeout / 4)
        # When the oldest ping not yet answered was sent (None: the last one was answered),
        # in monotonic seconds.
        self.unanswered_since: float | None = None

    async def run(self, alive: Callable[[], bool]) -> None:
        """Ping every ``ping_interval`` seconds while ``alive()``, one ping in flight at a
        time. A ping still unanswered after the health timeout is sent again (its late
        answer is dropped) but the stall is dated from the first one, so a hung loop stays
        unhealthy until it answers."""
        while alive():
            if self.unanswered_since is None:
                self.unanswered_since = time.monotonic()
            try:
                await self.ping(self.health_timeout)
            except asyncio.TimeoutError:
                continue
            except ServiceUnavailable:
                return
            self.unanswered_since = None
            await asyncio.sleep(self.ping_interval)

    def stalled(self) -> str | None:
        """Why the engine looks hung (a ping unanswered for longer than the health timeout),
        or None. Cheap: reads what the heartbeat recorded."""
        since = self.unanswered_since
        if since is None:
            return None
        waited = time.monotonic() - since
        if waited <= self.health_timeout:
            return None
        return (
            f"the scheduler has not answered a liveness ping for {waited:.0f}s "
            f"(health timeout {self.health_timeout:g}s): it looks hung"
        )
