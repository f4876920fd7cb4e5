"""The command line: one parser whose engine flags are generated from `EngineConfig`'s fields
(so a new config field is a new flag, with the same name everywhere), plus server flags (the
core's, and those extensions register as server option groups)."""

from __future__ import annotations

import argparse

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
    add_flags(parser, ServerArgs, "server")
    for group in option_groups(server=True):
        add_flags(parser, group.options, group.title)
    shell = parser.add_argument_group("shell")
    shell.add_argument("--shell", action="store_true", help="interactive chat shell, no server")
    shell.add_argument("--temperature", type=float, default=0.6, help="shell: sampling temperature")
    shell.add_argument("--top-p", type=float, default=0.95, help="shell: nucleus sampling")
    shell.add_argument("--max-tokens", type=int, default=512, help="shell: longest answer")
    return parser


def server_args(args: argparse.Namespace, config: EngineConfig) -> ServerArgs:
    """The server's settings from the parsed flags, with every server option group's values
    (ValueError naming a bad one)."""
    groups = option_groups(server=True)
    extensions = tuple(
        g.options(**{n: getattr(args, n) for n in option_names(g.options)}) for g in groups
    )
    for g in groups:
        g.check(config)
    values = {n: getattr(args, n) for n in option_names(ServerArgs)}
    # An empty key (e.g. MINISGL_API_KEY= in a unit file) means "no key", not "".
    values["api_key"] = args.api_key or API_KEY.get() or None
    return ServerArgs(**values, extensions=extensions)


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
    from minisgl.server.launchers import launch

    return launch(config, settings)
