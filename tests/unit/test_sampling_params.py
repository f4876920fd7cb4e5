"""SamplingParams: one frozen object, validated once where it is built."""

from __future__ import annotations

import dataclasses

import pytest

from minisgl.sampling_params import SamplingParams


def test_sampling_params_are_built_once_and_frozen() -> None:
    """One validated object from the route to the scheduler: frozen, its checks run when it
    is built (not when it is copied per choice, or decoded from IPC)."""
    params = SamplingParams(max_tokens=None, stop="x", stop_regex=r"\d")
    assert params.stop == ["x"] and params.stop_regex == [r"\d"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5  # type: ignore[misc]
    with pytest.raises(ValueError, match="min_tokens"):
        dataclasses.replace(params, max_tokens=1, min_tokens=2)
    # The server's "fill the context", resolved by the scheduler process.
    assert params.with_max_tokens(7).max_tokens == 7
    with pytest.raises(ValueError, match="min_tokens"):
        dataclasses.replace(params, min_tokens=5).with_max_tokens(4)
