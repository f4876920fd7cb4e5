"""The torch reference backend against a per-row SDPA written out here: mixed batches (its
one-token rows are padded apart from the longer ones), GQA, paged KV, row order kept."""

from __future__ import annotations

import torch

from minisgl.attention.base import BatchLayout
from minisgl.attention.torch_backend import TorchBackend
from minisgl.kvcache.pool import KVPool


def _row_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float
) -> torch.Tensor:
    """q [e, Hq, D] over k/v [prefix + e, Hk, D], causal from the prefix on."""
    e, hq, d = q.shape
    group = hq // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    pos = torch.arange(k.shape[0])
    mask = pos[None, :] <= prefix + torch.arange(e)[:, None]
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(e, hq * d)


def test_mixed_batch_matches_per_row_attention() -> None:
    g = torch.Generator().manual_seed(0)
    hq, hk, d, ps = 4, 2, 16, 4
    prefix, ext = [9, 0, 30, 4, 2], [1, 13, 1, 1, 6]  # decodes interleaved with chunks
    seq = [p + e for p, e in zip(prefix, ext)]
    pages = sum((s + ps - 1) // ps for s in seq) + 2
    pool = KVPool(1, pages, ps, hk, d, torch.float32, torch.device("cpu"))
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=g))
    table = torch.zeros(len(seq) + 1, 64, dtype=torch.long)
    perm = torch.randperm(pool.num_slots, generator=g)
    used = 0
    for r, s in enumerate(seq):
        table[r + 1, :s] = perm[used : used + s]  # rows 1.. hold the batch, shuffled slots
        used += s
    layout = BatchLayout([r + 1 for r in range(len(seq))], prefix, ext, table)
    t = sum(ext)
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hk, hk))
    slots = torch.cat([table[r + 1, p : p + e] for r, (p, e) in enumerate(zip(prefix, ext))])
    backend = TorchBackend(pool)
    md = backend.prepare(layout, torch.device("cpu"))
    assert [grp.max_q for grp in md.groups] == [1, 13]  # decodes are not padded to 13
    out = backend.forward(q, k, v, 0, slots, md, d**-0.5)
    start = 0
    for r, (p, e) in enumerate(zip(prefix, ext)):
        kv = table[r + 1, : p + e]
        want = _row_attention(q[start : start + e], pool.k(0)[kv], pool.v(0)[kv], p, d**-0.5)
        torch.testing.assert_close(out[start : start + e], want, atol=1e-5, rtol=1e-5)
        start += e
    # A batch of one kind is one group, in order (no scatter).
    single = backend.prepare(BatchLayout([1, 3], [9, 30], [1, 1], table), torch.device("cpu"))
    assert len(single.groups) == 1 and single.groups[0].tokens is None
