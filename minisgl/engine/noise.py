"""Counter-based sampling noise: a hash of (seed, step, vocab id), so a request's tokens
depend only on its seed and output position, never on the rest of the batch. The
exponential race (Gumbel-max) argmax(logit/T - log E_v), E_v ~ Exp(1), over the tokens that
survive filtering draws from the renormalised softmax(logit/T)."""

from __future__ import annotations

import torch
from torch import Tensor


def i64(c: int) -> int:
    """The int64 with the same low 64 bits as `c` (torch has no full uint64 arithmetic)."""
    c &= (1 << 64) - 1
    return c - (1 << 64) if c >= 1 << 63 else c


_GAMMA = i64(0x9E3779B97F4A7C15)  # splitmix64 increment (odd, golden ratio)
_MUL1 = i64(0xBF58476D1CE4E5B9)
_MUL2 = i64(0x94D049BB133111EB)


def _shr(z: Tensor, k: int) -> Tensor:
    # torch's >> on int64 is arithmetic; masking off the smeared sign bits makes it logical.
    return (z >> k).bitwise_and_((1 << (64 - k)) - 1)


def _mix64_(z: Tensor) -> Tensor:
    # In place, so a [B, V] hash needs one extra [B, V] temporary at a time, not five.
    z.bitwise_xor_(_shr(z, 30)).mul_(_MUL1)
    z.bitwise_xor_(_shr(z, 27)).mul_(_MUL2)
    return z.bitwise_xor_(_shr(z, 31))


def mix64(z: Tensor) -> Tensor:
    """splitmix64 finaliser on int64 tensors (products wrap mod 2^64); returns a new tensor."""
    return _mix64_(z.clone())


def row_keys(seeds: Tensor, steps: Tensor) -> Tensor:
    """One 64-bit stream key per row, a pure function of (seed, step)."""
    return _mix64_(mix64(seeds).add_((steps + 1) * _GAMMA))


def _hash32(seeds: Tensor, steps: Tensor, ids: Tensor) -> Tensor:
    # Low 32 bits of splitmix64(key + (id + 1) * gamma), forced odd so that m / 2^32 > 0.
    z = _mix64_(row_keys(seeds, steps).unsqueeze(1) + (ids.to(torch.int64) + 1) * _GAMMA)
    return z.bitwise_and_(0xFFFFFFFF).bitwise_or_(1)


def uniform_noise(seeds: Tensor, steps: Tensor, ids: Tensor) -> Tensor:
    """u[b, j] = hash(seeds[b], steps[b], ids[b, j]) / 2^32 in (0, 1], float32; `ids` is
    [B, N] or [N]. The 64 largest odd hashes (p = 2^-25) round to exactly 1.0."""
    return _hash32(seeds, steps, ids).to(torch.float32).mul_(2.0**-32)


def race(scores: Tensor, seeds: Tensor, steps: Tensor, ids: Tensor) -> Tensor:
    """argmax_j(scores[b, j] - log E[b, j]), E = -log1p(-u) ~ Exp(1): j with probability
    softmax(scores[b])_j; -inf (masked) entries never win, and row b depends on row b alone.
    log1p keeps small E (the winners) exact to 2^-32; u == 1.0 gives E = inf, so that
    token merely loses that one draw."""
    neg_u = _hash32(seeds, steps, ids).to(torch.float32).mul_(-(2.0**-32))
    return (scores - neg_u.log1p_().neg_().log_()).argmax(dim=-1)
