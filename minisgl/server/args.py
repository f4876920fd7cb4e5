"""The server's own settings (the command line's server flags, generated from these fields as
the engine's are from `EngineConfig`'s). Extensions add server flags by registering an
`OptionGroup` with ``server=True`` (minisgl/config.py); their values travel in
`ServerArgs.extensions`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TypeVar

from minisgl.config import check_fields, group_of, option
from minisgl.env import API_KEY

C = TypeVar("C")


@dataclass(frozen=True)
class ServerArgs:
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(1919, "port to listen on")
    served_model_name: str | None = option(None, "model name in API responses")
    log_level: str = option(
        "info", "debug | info | warning | error", choices=("debug", "info", "warning", "error")
    )
    api_key: str | None = option(
        None,
        "require 'Authorization: Bearer <key>' on every route but /health and /health_generate "
        f"(default: ${API_KEY.env_name} if set, else no authentication)",
    )
    max_queued_requests: int | None = option(
        None,
        "answer 503 (Retry-After) instead of queueing more than this many waiting requests "
        "(default: unlimited)",
        low=0,
    )
    request_timeout: float | None = option(
        None,
        "abort requests still unfinished this many seconds after arrival, freeing their KV "
        "(HTTP 504 / an error event) (default: none)",
        low=0.001,
    )
    health_timeout: float = option(
        60.0,
        "/health answers 503 once the scheduler has left a liveness ping unanswered this many "
        "seconds (it looks hung; one step may legitimately take long, e.g. a huge prefill); "
        "/health_generate waits at most as long",
        low=0.1,
    )
    max_request_bytes: int = option(8 << 20, "larger request bodies get 413", low=1)
    shutdown_timeout: float = option(
        30.0,
        "on SIGTERM, how long (seconds) running requests may take to finish before they are "
        "aborted",
        low=0,
    )
    # The server option groups of extensions, one instance each (see `ext`).
    extensions: tuple[object, ...] = field(default=(), metadata={"internal": True})

    def __post_init__(self) -> None:
        check_fields(self)

    def __repr__(self) -> str:  # the key is never printed
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.name != "api_key"]
        shown.append(f"api_key={'<set>' if self.api_key else None}")
        return f"ServerArgs({', '.join(shown)})"

    def ext(self, kind: type[C]) -> C:
        """The options of one extension's server group (its defaults if it was not given)."""
        return group_of(self.extensions, kind)
