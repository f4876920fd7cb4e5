"""What the routes share: model facts from the startup handshake, the IPC frontend, metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from minisgl.ipc.messages import SubmitItem
from minisgl.server.errors import APIError, bad_request
from minisgl.server.frontend import Draining, Frontend, RequestGroup, ServiceUnavailable
from minisgl.server.metrics import ServerMetrics


@dataclass(frozen=True)
class ModelInfo:
    served_model_name: str
    model_path: str
    context_length: int
    engine: dict[str, Any] = field(default_factory=dict)  # the scheduler's ready report


@dataclass
class ServerState:
    info: ModelInfo
    frontend: Frontend
    metrics: ServerMetrics
    created: int
    reasoning_parser: str | None = None  # server/reasoning.py

    @property
    def served_model_name(self) -> str:
        return self.info.served_model_name

    @property
    def speculative(self) -> bool:
        """Whether the engine speculates: responses then report the speculation figures."""
        return bool(self.info.engine.get("speculative_algorithm"))

    def submit(self, items: list[SubmitItem]) -> RequestGroup:
        try:
            return self.frontend.submit(items)
        except Draining as exc:
            raise APIError(503, str(exc)) from None
        except ServiceUnavailable as exc:
            raise APIError(503, f"the engine is not available: {exc}") from None
        except ValueError as exc:
            raise bad_request(exc) from None


def server_state(request: Request) -> ServerState:
    return request.app.state.minisgl  # type: ignore[no-any-return]
