"""The command line: one parser whose engine flags are generated from `EngineConfig`'s fields
(so a new config field is a new flag, with the same name everywhere), plus server flags."""

from __future__ import annotations

import argparse
from typing import Any

from minisgl.config import add_engine_flags, add_flags, engine_config, option_groups
from minisgl.env import API_KEY


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
    server.add_argument(
        "--reasoning-parser", default=None, choices=["qwen3", "deepseek-r1"],
        help="chat replies: put the model's thinking (<think>...</think>) in reasoning_content",
    )  # fmt: skip
    server.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"],
        help="logging verbosity",
    )  # fmt: skip
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


def _number(kind: type, minimum: float, name: str) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error messages
    return parse


def add_reliability_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server protection")
    group.add_argument(
        "--api-key", default=None, metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health and "
        f"/health_generate (default: ${API_KEY.env_name} if set, else no authentication)",
    )  # fmt: skip
    group.add_argument(
        "--max-queued-requests", type=_number(int, 0, "--max-queued-requests"), default=None,
        metavar="N", help="answer 503 (Retry-After) instead of queueing more than N waiting "
        "requests (default: unlimited)",
    )  # fmt: skip
    group.add_argument(
        "--request-timeout", type=_number(float, 0.001, "--request-timeout"), default=None,
        metavar="S", help="abort requests still unfinished S seconds after arrival, freeing "
        "their KV (HTTP 504 / an error event) (default: none)",
    )  # fmt: skip
    group.add_argument(
        "--health-timeout", type=_number(float, 0.1, "--health-timeout"), default=60.0,
        metavar="S", help="/health answers 503 once the scheduler has left a liveness ping "
        "unanswered for S seconds (it looks hung; one step may legitimately take long, e.g. "
        "a huge prefill); /health_generate waits at most S for output (default: 60)",
    )  # fmt: skip
    group.add_argument(
        "--max-request-bytes", type=_number(int, 1, "--max-request-bytes"), default=8 << 20,
        metavar="N", help="larger request bodies get 413 (default: 8 MiB)",
    )  # fmt: skip
    group.add_argument(
        "--shutdown-timeout", type=_number(float, 0, "--shutdown-timeout"), default=30.0,
        metavar="S", help="on SIGTERM, how long running requests may take to finish before "
        "they are aborted (default: 30)",
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = engine_config(args)
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
    from minisgl.server.launch import ServerArgs, serve

    return serve(
        config,
        ServerArgs(
            host=args.host, port=args.port,
            served_model_name=args.served_model_name, log_level=args.log_level,
            # An empty key (e.g. MINISGL_API_KEY= in a unit file) means "no key", not "".
            api_key=args.api_key or API_KEY.get() or None,
            max_queued_requests=args.max_queued_requests,
            request_timeout=args.request_timeout,
            health_timeout=args.health_timeout,
            max_request_bytes=args.max_request_bytes,
            shutdown_timeout=args.shutdown_timeout,
            reasoning_parser=args.reasoning_parser,
        ),
    )  # fmt: skip
