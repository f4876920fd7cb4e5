"""The server's own settings (the command line's server flags), beside the engine's
`EngineConfig`. Extensions add server flags by registering an `OptionGroup` with
``server=True`` (minisgl/config.py); their values travel in `ServerArgs.extensions`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TypeVar

C = TypeVar("C")


@dataclass(frozen=True)
class ServerArgs:
    host: str = "127.0.0.1"
    port: int = 1919
    served_model_name: str | None = None
    log_level: str = "info"
    api_key: str | None = field(default=None, repr=False)  # never printed, see __repr__
    max_queued_requests: int | None = None  # waiting requests beyond this get 503
    request_timeout: float | None = None  # seconds from arrival to abort
    health_timeout: float = 60.0  # an unanswered liveness ping makes /health 503 after this
    max_request_bytes: int = 8 << 20
    shutdown_timeout: float = 30.0  # SIGTERM: how long running requests may still take
    # The server option groups of extensions, one instance each (see `ext`).
    extensions: tuple[object, ...] = ()

    def __repr__(self) -> str:
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr]
        shown.append(f"api_key={'<set>' if self.api_key else None}")
        return f"ServerArgs({', '.join(shown)})"

    def ext(self, kind: type[C]) -> C:
        """The options of one extension's server group (its defaults if it was not given)."""
        for group in self.extensions:
            if isinstance(group, kind):
                return group
        return kind()
