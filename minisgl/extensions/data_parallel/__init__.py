"""Data parallelism: ``--dp-size N`` starts N engine replicas (one server each, on free local
ports) and SGLang's router (sglang-router, the optional extra ``minisgl[router]``) in front
of them on ``--port``. The router balances requests (cache-aware by default), checks health,
retries and exports Prometheus metrics; minisgl writes no router of its own.

- options.py: the server flags and the checks of a plan (GPUs, the router installed).
- launcher.py: the processes: start, watch (a replica that exits leaves the router), drain.
- Core interface: a `Launcher` (minisgl/server/launchers.py) that takes ``--dp-size`` > 1."""

from __future__ import annotations

from minisgl.config import EngineConfig, OptionGroup, register_options
from minisgl.extensions.data_parallel.options import DataParallelOptions
from minisgl.server.args import ServerArgs
from minisgl.server.launchers import Launcher, register_launcher


def _takes(config: EngineConfig, args: ServerArgs) -> bool:
    return args.ext(DataParallelOptions).dp_size > 1


def _run(config: EngineConfig, args: ServerArgs) -> int:
    from minisgl.extensions.data_parallel.launcher import serve_replicas

    return serve_replicas(config, args)


register_options(OptionGroup("data parallel", DataParallelOptions, server=True))
register_launcher(Launcher("data_parallel", _takes, _run))
