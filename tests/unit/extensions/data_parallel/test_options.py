"""--dp-size's checks: the GPUs go round or the error says why, the CPU threads are shared,
a bad value or a missing router is a clear error at startup, and the router gets our flags
with the user's on top."""

from __future__ import annotations

import logging
import sys

import pytest

from minisgl import env
from minisgl.cli import main, server_args
from minisgl.config import EngineConfig
from minisgl.extensions.data_parallel.launcher import serve_replicas
from minisgl.extensions.data_parallel.options import (
    VISIBLE_GPUS,
    DataParallelOptions,
    cpu_threads,
    replica_gpus,
    visible_gpus,
)
from minisgl.extensions.data_parallel.router import router_argv
from minisgl.server.args import ServerArgs


def test_each_replica_gets_its_gpus() -> None:
    assert replica_gpus(2, 1, "auto", ["0", "1"]) == ["0", "1"]
    assert replica_gpus(2, 2, "cuda", ["0", "1", "2", "3"]) == ["0,1", "2,3"]
    assert replica_gpus(2, 1, "auto", ["4", "6", "7"]) == ["4", "6"]  # CUDA_VISIBLE_DEVICES order
    assert replica_gpus(4, 1, "auto", []) is None  # no GPU: replicas share the CPU
    assert replica_gpus(4, 1, "cpu", ["0"]) is None


@pytest.mark.parametrize(
    ("dp", "tp", "device", "gpus", "message"),
    [
        (3, 1, "auto", 2, "--dp-size 3 x --tp-size 1 needs 3 GPUs, but 2 are visible"),
        (2, 2, "cuda", 3, "--dp-size 2 x --tp-size 2 needs 4 GPUs, but 3 are visible"),
        (2, 1, "cuda", 0, "needs 2 GPUs, but 0 are visible"),
        (2, 1, "cuda:1", 2, "--device cuda:1 names one GPU"),
    ],
)
def test_too_few_gpus_is_a_clear_error(
    dp: int, tp: int, device: str, gpus: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        replica_gpus(dp, tp, device, [str(i) for i in range(gpus)])


def test_visible_gpus_follow_cuda_visible_devices() -> None:
    with env.override({VISIBLE_GPUS: "3,5"}):
        assert visible_gpus(2) == ["3", "5"]
    with env.override({VISIBLE_GPUS: None}):
        assert visible_gpus(2) == ["0", "1"]


def test_replicas_share_the_cores() -> None:
    assert cpu_threads(2, 1, 16) == 8
    assert cpu_threads(2, 2, 16) == 4
    assert cpu_threads(4, 1, 2) == 1


def test_dp_size_zero_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--dp-size", "0"])
    assert exc.value.code == 2
    assert "dp_size=0 is invalid" in capsys.readouterr().err


def test_dp_size_is_a_server_option_not_an_engine_one() -> None:
    with pytest.raises(ValueError, match="unknown option"):
        EngineConfig.from_kwargs(dp_size=2)  # LLM(...) takes the same keywords


def test_without_the_router_dp_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "sglang_router", None)  # as if not installed
    args = ServerArgs(extensions=(DataParallelOptions(dp_size=2),))
    with caplog.at_level(logging.ERROR):
        assert serve_replicas(EngineConfig(device="cpu"), args) == 2
    assert "pip install 'minisgl[router]'" in caplog.text


def test_the_router_gets_our_flags_then_the_users() -> None:
    from minisgl.cli import build_parser

    parsed = build_parser().parse_args(
        ["--dp-size", "2", "--router-policy", "round_robin", "--port", "9000"]
        + ["--router-args", "--balance-abs-threshold 7 --port 9001"]
    )
    args = server_args(parsed, EngineConfig())
    opts = args.ext(DataParallelOptions)
    argv = router_argv(args, opts, ["http://127.0.0.1:1", "http://127.0.0.1:2"], 29000)
    assert argv[argv.index("--worker-urls") + 1 : argv.index("--worker-urls") + 3] == [
        "http://127.0.0.1:1",
        "http://127.0.0.1:2",
    ]
    assert argv[argv.index("--policy") + 1] == "round_robin"
    assert argv[-4:] == ["--balance-abs-threshold", "7", "--port", "9001"]
    assert "--api-key" not in argv  # the key never goes on a command line
