"""What the routes share: model facts from the startup handshake, the IPC frontend (and the
observers it reports to), and the chat hook of the extensions."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from fastapi import Request

from minisgl.ipc.messages import JSONDict, SubmitItem
from minisgl.sampling_params import SamplingParams
from minisgl.server.chat_hooks import ChatHook, PlainChat
from minisgl.server.errors import APIError, Draining, ServiceUnavailable, bad_request
from minisgl.server.frontend import Frontend
from minisgl.server.request_group import Prompt, RequestGroup, make_items

logger = logging.getLogger(__name__)

STATS_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ModelInfo:
    served_model_name: str
    model_path: str
    context_length: int
    tokenizer_path: str
    tp_size: int
    engine: JSONDict = field(default_factory=dict)  # the scheduler's ready report


@dataclass
class ServerState:
    info: ModelInfo
    frontend: Frontend
    created: int
    chat: ChatHook = field(default_factory=PlainChat)  # tools and reasoning (chat_hooks.py)

    @property
    def served_model_name(self) -> str:
        return self.info.served_model_name

    def submit(
        self, prompts: Sequence[Prompt], params: SamplingParams, base: SubmitItem, name: str
    ) -> RequestGroup:
        """A sequence per prompt and choice (``params.n`` of them); ``name`` is the id the
        response carries, by which /abort_request finds the group."""
        choices = [params.for_choice(i) for i in range(params.n)]
        try:
            group = self.frontend.submit(make_items(prompts, choices, base))
        except Draining as exc:
            raise APIError(503, str(exc)) from None
        except ServiceUnavailable as exc:
            raise APIError(503, f"the engine is not available: {exc}") from None
        except ValueError as exc:
            raise bad_request(exc) from None
        self.frontend.name(group, name)
        return group

    async def refresh_stats(self) -> None:
        """Fetch the scheduler's stats for the observers (e.g. before /metrics renders)."""
        try:
            reply = await self.frontend.control("stats", STATS_TIMEOUT_S)
        except (asyncio.TimeoutError, ServiceUnavailable):
            logger.warning("scheduler stats unavailable; serving the last values")
            return
        self.frontend.observers.on_stats(reply.data)


def server_state(request: Request) -> ServerState:
    return request.app.state.minisgl  # type: ignore[no-any-return]
