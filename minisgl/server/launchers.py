"""Launchers that serve a command line in place of the one-engine server: an extension whose
server flags ask for more than one engine (data_parallel's ``--dp-size``) registers one, and
``python -m minisgl`` runs the first that takes the settings, else `serve`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from minisgl.config import EngineConfig
from minisgl.server.args import ServerArgs


@dataclass(frozen=True)
class Launcher:
    name: str
    takes: Callable[[EngineConfig, ServerArgs], bool]  # these settings are this launcher's
    run: Callable[[EngineConfig, ServerArgs], int]  # serve until stopped: the exit code


_launchers: list[Launcher] = []


def register_launcher(launcher: Launcher) -> None:
    _launchers.append(launcher)


def launch(config: EngineConfig, args: ServerArgs) -> int:
    """Serve with the first registered launcher that takes these settings, else one engine."""
    from minisgl.extension_loader import load_extensions

    load_extensions()
    for launcher in _launchers:
        if launcher.takes(config, args):
            return launcher.run(config, args)
    from minisgl.server.launch import serve

    return serve(config, args)
