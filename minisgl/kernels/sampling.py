"""The sampler's exponential race as one Triton kernel (CUDA).

Same draw as ``minisgl.engine.sampler.race``: argmax_j(scores[b, j] - log E[b, j]) with
E = -log1p(-u), u = hash(seed, step, id) / 2^32, the same splitmix64 hash bit for bit (the
float logs may round a few ulps apart from torch's, so rare near-ties can pick differently). Eager
torch needs ~20 passes over [B, V] for it; this is one pass, with no compilation at run
time and no guards to check per call (torch.compile's cost on the host every step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048


@triton.jit
def _mix64(z):
    # splitmix64 finaliser on uint64 (shifts are logical, products wrap mod 2^64).
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _log1p(x):
    # Kahan's log1p: exact where 1 + x rounds to 1, a few ulps elsewhere. The winners of the
    # race are the smallest E = -log1p(-u), so small u must not collapse to log(1) = 0.
    y = 1.0 + x
    return tl.where(y == 1.0, x, tl.log(y) * (x / (y - 1.0)))


@triton.jit(do_not_specialize=["n_cols"])
def _race_kernel(
    scores_ptr, ids_ptr, seeds_ptr, steps_ptr, out_ptr, n_cols, stride_s, stride_i,
    HAS_IDS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    gamma = 0x9E3779B97F4A7C15
    seed = tl.load(seeds_ptr + row).to(tl.uint64)
    step = tl.load(steps_ptr + row).to(tl.uint64)
    key = _mix64(_mix64(seed) + (step + 1) * gamma)
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int64)
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_cols
        s = tl.load(scores_ptr + row * stride_s + offs, mask=mask, other=float("-inf"))
        if HAS_IDS:
            vid = tl.load(ids_ptr + row * stride_i + offs, mask=mask, other=0).to(tl.uint64)
        else:
            vid = offs.to(tl.uint64)
        h = (_mix64(key + (vid + 1) * gamma) & 0xFFFFFFFF) | 1
        neg_u = h.to(tl.float32) * -2.3283064365386963e-10  # -(2^-32)
        val = s.to(tl.float32) - tl.log(-_log1p(neg_u))
        val = tl.where(mask, val, float("-inf"))
        m = tl.max(val, axis=0)
        i = tl.argmax(val, axis=0)  # first maximum, as torch.argmax
        take = m > best  # strict: an earlier block keeps ties
        best_idx = tl.where(take, start + i.to(tl.int64), best_idx)
        best = tl.where(take, m, best)
    tl.store(out_ptr + row, best_idx)


def triton_race(
    scores: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Index j of the winner per row of ``scores`` [B, N]; ``ids`` [N] (vocabulary ids in
    order: ``arange``) or [B, N] (the ids of a top-k's columns)."""
    scores = scores.contiguous()
    rows, n = scores.shape
    out = torch.empty(rows, dtype=torch.int64, device=scores.device)
    if rows == 0:
        return out
    has_ids = ids.dim() == 2
    ids = ids.contiguous() if has_ids else scores  # 1-D ids are the column index itself
    _race_kernel[(rows,)](
        scores, ids, seeds, steps, out, n, scores.stride(0), ids.stride(0) if has_ids else 0,
        HAS_IDS=has_ids, BLOCK=_BLOCK, num_warps=8,
    )  # fmt: skip
    return out
