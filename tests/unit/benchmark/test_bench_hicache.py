"""benchmark/offline/bench_hicache.py runs, small, on a tiny model: outputs identical, less
prefill with HiCache on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmark.offline import bench_hicache


def test_small_run(
    tiny_models: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = "--conversations 8 --turns 3 --history 96 --question 8 --max-tokens 2 --page-size 1"
    argv = ["bench_hicache.py", "--model", str(tiny_models["llama"]), *args.split()]
    monkeypatch.setattr(sys, "argv", argv)
    bench_hicache.main()
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["greedy_outputs_identical"] is True
    assert result["on"]["bytes_to_device"] > 0 and result["on"]["bytes_to_host"] > 0
    assert result["prefill_ratio_on_off"] < 0.6, result
