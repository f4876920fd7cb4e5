"""Verification of draft tokens by rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

For each row, the target's distributions p_0..p_k at the k draft positions plus one, and the
draft's q_1..q_k (one-hot for deterministic drafts such as n-grams): draft token d_j is kept
with probability min(1, p(d_j) / q(d_j)); at the first rejection a token is drawn from
normalize(max(p - q, 0)); if all k are kept, a bonus token is drawn from p_k. The emitted
tokens are distributed exactly as the target's; greedy targets (one-hot p) keep exactly the
draft tokens that equal the target's argmax.

Randomness is counter based on (seed, step) like the sampler's, so a request's tokens do
not depend on the rest of the batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from minisgl.engine.noise import i64, race, uniform_noise

_ACCEPT_ID = -1  # hash id reserved for the acceptance coin, distinct from every vocab id


def verify(
    target_probs: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    seeds: Tensor,
    steps: Tensor,
) -> tuple[Tensor, Tensor]:
    """target_probs [B, K+1, V]; draft_tokens [B, K] (pad with -1 where a row drafted fewer);
    draft_probs [B, K, V] or None for deterministic drafts; steps [B] = output position of
    the first new token. Returns (tokens [B, K+1], num_emitted [B]): row b emits
    tokens[b, :num_emitted[b]] (accepted drafts, then one corrected or bonus token)."""
    bsz, k1, vocab = target_probs.shape
    k = k1 - 1
    valid = draft_tokens >= 0
    d = draft_tokens.clamp(min=0)
    p_d = target_probs[:, :k].gather(2, d[..., None])[..., 0]  # [B, K]
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
    else:
        q_d = draft_probs.gather(2, d[..., None])[..., 0]
    pos = steps[:, None] + torch.arange(k, device=steps.device)[None, :]
    coin = uniform_noise(
        seeds.repeat_interleave(k),
        pos.reshape(-1),
        torch.full((1,), _ACCEPT_ID, device=steps.device),
    ).view(bsz, k)
    accept = (coin * q_d <= p_d) & valid
    # Number of leading accepted drafts per row.
    n_acc = torch.cumprod(accept.to(torch.int64), dim=1).sum(dim=1)
    # Distribution of the final token: residual at the first rejection, else p_k.
    rows = torch.arange(bsz, device=steps.device)
    p_last = target_probs[rows, n_acc]  # [B, V]
    rejected = n_acc < valid.sum(dim=1)
    if draft_probs is None:
        q_last = torch.zeros_like(p_last)
        q_last[rows, d[rows, n_acc.clamp(max=max(k - 1, 0))]] = 1.0
    else:
        q_last = draft_probs[rows, n_acc.clamp(max=max(k - 1, 0))]
    residual = (p_last - q_last).clamp(min=0)
    # A row whose drafts ran out early (padding) was not rejected: it samples from p.
    dist = torch.where(rejected[:, None], residual, p_last)
    dist = torch.where(dist.sum(-1, keepdim=True) > 0, dist, p_last)
    ids = torch.arange(vocab, device=steps.device)
    last = race(
        dist.clamp(min=1e-30).log().masked_fill(dist <= 0, float("-inf")), seeds, steps + n_acc, ids
    )
    tokens = torch.cat([d, torch.zeros_like(d[:, :1])], dim=1)
    tokens[rows, n_acc] = last
    return tokens, n_acc + 1


def verify_greedy(target_logits: Tensor, draft_tokens: Tensor) -> tuple[Tensor, Tensor]:
    """``verify`` for greedy targets, from logits [B, K+1, V]: keep the drafts that equal the
    target's argmax; the next token is the argmax after the last kept draft. Returns what
    ``verify`` returns with one-hot target probabilities."""
    best = target_logits.argmax(dim=-1)  # [B, K+1]
    k = draft_tokens.shape[1]
    n_acc = torch.cumprod((draft_tokens == best[:, :k]).to(torch.int64), dim=1).sum(dim=1)
    return best, n_acc + 1


def verify_drafts(
    drafts: Tensor,
    draft_probs: Tensor | None,
    temperatures: list[float],
    seeds: list[int],
    steps: list[int],
    device: torch.device,
    logits: Tensor,
) -> list[Tensor | None]:
    """The target's logits at each verifying row's k + 1 positions ([S * (K + 1), V]) ->
    [tokens [S, K + 1], counts [S]] (see ``verify``); ``temperatures`` 0 for greedy rows,
    ``steps`` the output position of each row's first new token."""
    rows = len(temperatures)
    logits = logits.view(rows, -1, logits.shape[-1])
    if not any(temperatures):
        # Greedy rows need neither probabilities nor noise: what rejection sampling with
        # one-hot targets would emit, at a fraction of the cost (this runs every step).
        return list(verify_greedy(logits, drafts))
    temps = torch.tensor(temperatures, dtype=torch.float32).to(device)
    greedy = temps == 0
    scale = torch.where(greedy, torch.ones_like(temps), temps)
    probs = torch.softmax(logits.float() / scale[:, None, None], dim=-1)
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(probs.dtype)
    probs = torch.where(greedy[:, None, None], one_hot, probs)
    seed_t = torch.tensor([i64(x) for x in seeds], dtype=torch.long).to(device)
    step_t = torch.tensor(steps, dtype=torch.long).to(device)
    tokens, counts = verify(probs, drafts, draft_probs, seed_t, step_t)
    return [tokens, counts]
