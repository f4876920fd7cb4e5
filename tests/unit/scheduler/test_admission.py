"""Admission's in-batch shared-prefix check: a prompt that shares a long uncached prefix with
one admitted in the same batch waits for it, by the definition (the common prefix) and on
long prompts."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from minisgl.scheduler.admission import IN_BATCH_PREFIX_MIN, _shares_prefix


def _common_prefix(a: list[int], b: list[int]) -> int:  # the definition the check replaced
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


@given(
    st.lists(st.integers(0, 2), min_size=0, max_size=80),
    st.lists(st.integers(0, 2), min_size=0, max_size=80),
    st.integers(0, 48),
)
def test_shared_prefix_check_matches_the_common_prefix(a: list[int], b: list[int], cached: int):
    # Small alphabets so that long common prefixes occur.
    expected = _common_prefix(a, b) - cached >= IN_BATCH_PREFIX_MIN
    assert _shares_prefix(a, b, cached + IN_BATCH_PREFIX_MIN) == expected


def test_shared_prefix_check_on_long_prompts() -> None:
    rng = random.Random(0)
    system = [rng.randrange(3, 4096) for _ in range(2000)]
    a = system + [rng.randrange(3, 4096) for _ in range(100)]
    b = system + [rng.randrange(3, 4096) for _ in range(100)]
    assert _shares_prefix(a, b, IN_BATCH_PREFIX_MIN)  # nothing cached yet: defer b
    assert not _shares_prefix(a, b, 2000 + IN_BATCH_PREFIX_MIN)  # system prompt cached
    c = list(a)
    c[5] += 1  # differs inside the cached part, agrees after it
    assert not _shares_prefix(a, c, 1000 + IN_BATCH_PREFIX_MIN)
