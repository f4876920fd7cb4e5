"""The command line: every engine option is a flag, the defaults are the configuration's,
flags reach the configuration, and a bad value is a usage error."""

from __future__ import annotations

import dataclasses

import pytest

from minisgl.cli import build_parser, engine_config
from minisgl.config import EngineConfig, option_names


def test_every_config_field_is_a_flag() -> None:
    parser = build_parser()
    flags = {opt for action in parser._actions for opt in action.option_strings}
    for name in option_names(EngineConfig):
        assert "--" + name.replace("_", "-") in flags, name
    for alias in ("--tp", "--model-path", "--host", "--port", "--shell", "--served-model-name"):
        assert alias in flags


def test_defaults_match_the_config() -> None:
    # from_kwargs: the core's defaults and every loaded extension's option group's.
    defaults = EngineConfig.from_kwargs()
    assert engine_config(build_parser().parse_args([])) == defaults
    assert dataclasses.replace(defaults, extensions=()) == EngineConfig()


def test_flags_reach_the_config() -> None:
    args = build_parser().parse_args(
        ["--model-path", "m", "--page-size", "16", "--tp", "2", "--disable-mixed-batch"]
        + ["--cache", "naive", "--cuda-graph-max-bs", "0", "--port", "8000"]
    )
    cfg = engine_config(args)
    assert (cfg.model, cfg.page_size, cfg.tp_size, cfg.disable_mixed_batch) == ("m", 16, 2, True)
    assert (cfg.cache, cfg.cuda_graph_max_bs, args.port) == ("naive", 0, 8000)


def test_bad_flag_values_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from minisgl.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--page-size", "0"])
    assert exit_info.value.code == 2
    assert "page_size" in capsys.readouterr().err
