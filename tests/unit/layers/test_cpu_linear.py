"""The CPU linear paths (W @ x^T for <= 2 rows, oneDNN from 3) agree with F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisgl.layers.cpu_linear import ONEDNN, ONEDNN_MAX_ROWS, linear, onednn_rows, pack


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17, 64, 65, 200, 256, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=gen)
    b = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 64, generator=gen)
    ref = F.linear(x, w, b)
    packed = pack(w)
    assert (packed is not None) == ONEDNN
    for p in (None, packed):
        out = linear(x, w, b, p)
        assert out.shape == ref.shape and out.is_contiguous()
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # Other dtypes and 3-d inputs take F.linear unchanged.
    assert torch.equal(linear(x.double(), w.double()), F.linear(x.double(), w.double()))
    assert torch.equal(linear(x[None], w, b), F.linear(x[None], w, b))


def test_onednn_shapes_are_bounded() -> None:
    """oneDNN keeps a primitive per distinct shape (its memory grew without bound in a soak
    test): every row count it sees is padded to one of a few bucket sizes."""
    buckets = {onednn_rows(r) for r in range(3, ONEDNN_MAX_ROWS + 1)}
    assert buckets == set(range(3, 17)) | {32, 64, 128, 192, 256}
    assert all(onednn_rows(r) >= r for r in range(3, ONEDNN_MAX_ROWS + 1))
