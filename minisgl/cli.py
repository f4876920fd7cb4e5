"""The command line: one parser whose engine flags are generated from `EngineConfig`'s fields
(so a new config field is a new flag, with the same name everywhere), plus server flags (the
core's, and those extensions register as server option groups)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from minisgl.config import (
    EngineConfig,
    add_engine_flags,
    add_flags,
    engine_config,
    option_groups,
    option_names,
)
from minisgl.env import API_KEY
from minisgl.extension_loader import loaded_extensions
from minisgl.server.args import ServerArgs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minisgl",
        description="minisgl: serve an LLM over an OpenAI-compatible API, or chat in a shell.",
        allow_abbrev=False,  # a prefix of one flag must not silently become another flag
    )
    add_engine_flags(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=1919, help="port to listen on")
    server.add_argument("--served-model-name", default=None, help="model name in API responses")
    levels = ["debug", "info", "warning", "error"]
    server.add_argument("--log-level", default="info", choices=levels, help="logging verbosity")
    add_reliability_flags(parser)
    for group in option_groups():
        if group.server:
            add_flags(parser, group.options, group.title)
    shell = parser.add_argument_group("shell")
    shell.add_argument("--shell", action="store_true", help="interactive chat shell, no server")
    shell.add_argument("--temperature", type=float, default=0.6, help="shell: sampling temperature")
    shell.add_argument("--top-p", type=float, default=0.95, help="shell: nucleus sampling")
    shell.add_argument("--max-tokens", type=int, default=512, help="shell: longest answer")
    return parser


def _number(kind: Callable[[str], float], minimum: float, name: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}, got {text}")
        return value

    parse.__name__ = getattr(kind, "__name__", "number")  # argparse names it in its errors
    return parse


# (flag, type, minimum, default, metavar, help) of the flags that protect a running server.
_RELIABILITY: list[tuple[str, Callable[[str], float], float, object, str, str]] = [
    (
        "--max-queued-requests",
        int,
        0,
        None,
        "N",
        "answer 503 (Retry-After) instead of queueing more than N waiting requests "
        "(default: unlimited)",
    ),
    (
        "--request-timeout",
        float,
        0.001,
        None,
        "S",
        "abort requests still unfinished S seconds after arrival, freeing their KV (HTTP 504 / "
        "an error event) (default: none)",
    ),
    (
        "--health-timeout",
        float,
        0.1,
        60.0,
        "S",
        "/health answers 503 once the scheduler has left a liveness ping unanswered for S "
        "seconds (it looks hung; one step may legitimately take long, e.g. a huge prefill); "
        "/health_generate waits at most S for output (default: 60)",
    ),
    ("--max-request-bytes", int, 1, 8 << 20, "N", "larger request bodies get 413 (default: 8 MiB)"),
    (
        "--shutdown-timeout",
        float,
        0,
        30.0,
        "S",
        "on SIGTERM, how long running requests may take to finish before they are aborted "
        "(default: 30)",
    ),
]


def add_reliability_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server protection")
    group.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health and "
        f"/health_generate (default: ${API_KEY.env_name} if set, else no authentication)",
    )
    for flag, kind, minimum, default, metavar, help_text in _RELIABILITY:
        parse = _number(kind, minimum, flag)
        group.add_argument(flag, type=parse, default=default, metavar=metavar, help=help_text)


def server_args(args: argparse.Namespace, config: EngineConfig) -> ServerArgs:
    """The server's settings from the parsed flags, with every server option group's values
    (ValueError naming a bad one)."""
    groups = [g for g in option_groups() if g.server]
    extensions = tuple(
        g.options(**{n: getattr(args, n) for n in option_names(g.options)}) for g in groups
    )
    for g in groups:
        g.check(config)
    return ServerArgs(
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        log_level=args.log_level,
        # An empty key (e.g. MINISGL_API_KEY= in a unit file) means "no key", not "".
        api_key=args.api_key or API_KEY.get() or None,
        max_queued_requests=args.max_queued_requests,
        request_timeout=args.request_timeout,
        health_timeout=args.health_timeout,
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout=args.shutdown_timeout,
        extensions=extensions,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # A flag of an extension that is not loaded lands here too: say which ones are.
        loaded = ", ".join(loaded_extensions()) or "none"
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (extensions loaded: {loaded})")
    try:
        config = engine_config(args)
        if not args.shell:
            settings = server_args(args, config)
    except ValueError as exc:
        parser.error(str(exc))
    if args.shell:
        from minisgl.sampling_params import SamplingParams
        from minisgl.shell import run_shell

        try:
            params = SamplingParams(
                temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens
            )
        except ValueError as exc:
            parser.error(str(exc))
        return run_shell(config, params)
    from minisgl.server.launch import serve

    return serve(config, settings)
