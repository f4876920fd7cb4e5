"""Batched on-device sampling: penalties, temperature, top-k/top-p/min-p, logprobs.

`Sampler.sample` never syncs with the host: the host flags of a `SamplingBatch` pick the
work. The noise is counter-based (noise.py): a request's tokens depend only on its seed and
output position, never on the rest of the batch."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from minisgl.engine.noise import i64, race
from minisgl.engine.penalties import PenaltyState, h2d
from minisgl.sampling_params import SamplingParams

# "top-k off": the sampler never masks a position >= the row's k, so any k >= V is off.
TOP_K_OFF = 1 << 30


def _min_p_mask(x: Tensor, row_max: Tensor, min_ps: Tensor) -> Tensor:
    # p_v < min_p * p_max <=> logit_v < max_logit + log(min_p); min_p == 0 masks nothing.
    return x.masked_fill(x < row_max + torch.log(min_ps).unsqueeze(1), float("-inf"))


@dataclass
class SamplingBatch:
    """The sampling rows of a step: their parameters, packed in two tensors, and the host
    flags that decide the sampler's work.

    A decode batch keeps the same rows for many steps, so the scheduler builds one batch on
    the host and reuses it until its rows change; `at` makes each step's, and copies the
    parameters to the device once."""

    floats: Tensor  # [6, B] float32: temperature (0: greedy), top_p, min_p, and the repetition,
    # frequency and presence penalties
    ints: Tensor  # [2, B] int64: top_k (TOP_K_OFF when off), seed
    need_rep: bool
    need_freq: bool
    need_pres: bool
    n_sampled: int  # rows that sample (the others are greedy)
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    max_top_k: int  # largest k over sampled rows (TOP_K_OFF if any is off)
    need_logprobs: bool
    max_top_logprobs: int
    steps: Tensor | None = None  # [B] int64: the output position each row samples (per step)

    @property
    def all_greedy(self) -> bool:
        return self.n_sampled == 0

    @property
    def any_greedy(self) -> bool:
        return self.n_sampled < self.floats.shape[1]

    @property
    def need_penalties(self) -> bool:
        return self.need_rep or self.need_freq or self.need_pres

    @property
    def need_filters(self) -> bool:
        """Whether any sampled row truncates its distribution (top-k, top-p or min-p)."""
        return self.need_top_k or self.need_top_p or self.need_min_p

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        steps: Sequence[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingBatch:
        """The batch of host lists; with ``steps`` (steps[i]: the output index row i samples),
        that step's, on ``device``."""
        fl: list[tuple[float, ...]] = []  # one row per request; transposed below
        ints: list[tuple[int, int]] = []
        n_sampled = max_k = 0
        need_k = need_p = need_min_p = need_rep = need_freq = need_pres = False
        for p, seed in zip(params, seeds, strict=True):
            rep, freq, pres = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
            need_rep, need_freq = need_rep or rep != 1.0, need_freq or freq != 0.0
            need_pres = need_pres or pres != 0.0
            k = TOP_K_OFF
            if p.temperature == 0 or p.top_k == 1:
                # Greedy rows get neutral filters so they never force a sort on the others.
                fl.append((0.0, 1.0, 0.0, rep, freq, pres))
            else:
                n_sampled += 1
                k = min(p.top_k, TOP_K_OFF) if p.top_k > 0 else TOP_K_OFF
                need_k, need_p = need_k or k < TOP_K_OFF, need_p or p.top_p < 1.0
                need_min_p = need_min_p or p.min_p > 0.0
                max_k = max(max_k, k)
                fl.append((p.temperature, p.top_p, p.min_p, rep, freq, pres))
            ints.append((k, i64(seed)))
        batch = cls(
            floats=torch.from_numpy(np.asarray(fl, dtype=np.float32).reshape(-1, 6).T.copy()),
            ints=torch.from_numpy(np.asarray(ints, dtype=np.int64).reshape(-1, 2).T.copy()),
            need_rep=need_rep,
            need_freq=need_freq,
            need_pres=need_pres,
            n_sampled=n_sampled,
            need_top_k=need_k,
            need_top_p=need_p,
            need_min_p=need_min_p,
            max_top_k=max_k,
            need_logprobs=any(p.wants_logprobs for p in params),
            max_top_logprobs=max((p.top_logprobs for p in params), default=0),
        )
        if steps is None:
            return batch
        return batch.at(h2d(torch.tensor(list(steps), dtype=torch.int64), device))

    def at(self, steps: Tensor) -> SamplingBatch:
        """The batch of one step: ``steps`` [B] int64 is on the device, where the parameters
        are copied the first time."""
        if self.floats.device != steps.device:
            self.floats, self.ints = h2d(self.floats, steps.device), h2d(self.ints, steps.device)
        return dataclasses.replace(self, steps=steps)


@dataclass
class SampleOutput:
    next_tokens: Tensor  # [B] int64
    chosen_logprobs: Tensor | None  # [B] float32, for every row when any row asked
    top_logprob_ids: Tensor | None  # [B, K] int64, K = max_top_logprobs, sorted descending
    top_logprobs: Tensor | None  # [B, K] float32


class Sampler:
    def __init__(self, use_triton: bool = False) -> None:
        # Eager, the [B, V] hash is ~20 memory passes (~3 ms at B=256, V=152k, H200); the
        # Triton kernel is one. Its float logs may round unlike eager's by a few ulps: keep
        # one Sampler per run.
        self._race: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor] = race
        # Temperature, greedy rows and the race in one pass over the logits in model dtype.
        self._fused: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor] | None = None
        if use_triton:
            from minisgl.kernels.sampling import triton_race, triton_sample

            self._race = triton_race
            self._fused = triton_sample

    def sample(
        self,
        logits: Tensor,
        batch: SamplingBatch,
        penalty_state: PenaltyState | None = None,
        penalty_rows: Tensor | None = None,
    ) -> SampleOutput:
        """One token per row of `logits` [B, V] (any float dtype; float32 math throughout);
        row b's penalty slot is penalty_rows[b]."""
        x, temps, seeds, steps = logits, batch.floats[0], batch.ints[1], batch.steps
        assert steps is not None, "a step's batch (SamplingBatch.at)"
        if batch.need_penalties:
            x = self._apply_penalties(x.float(), batch, penalty_state, penalty_rows)
        if batch.all_greedy:
            next_tokens = x.argmax(dim=-1)  # with no penalties, the whole step is one kernel
        elif self._fused is not None and not (batch.need_penalties or batch.need_filters):
            # The common case: no float32 copy, no scaled copy, greedy rows inside.
            next_tokens = self._fused(logits, temps, seeds, steps)
        else:
            next_tokens = self._sample_rows(x.float(), batch, steps)
            if batch.any_greedy:
                greedy = x.argmax(dim=-1)
                next_tokens = torch.where(temps == 0, greedy, next_tokens)
        return self._logprobs(logits, next_tokens, batch)

    @staticmethod
    def _apply_penalties(
        x: Tensor, batch: SamplingBatch, state: PenaltyState | None, rows: Tensor | None
    ) -> Tensor:
        if state is None or state.output_counts is None or state.prompt_mask is None:
            raise ValueError("a row uses penalties but no allocated PenaltyState was passed")
        rows = torch.arange(x.shape[0], device=x.device) if rows is None else rows
        counts = state.output_counts.index_select(0, rows)
        rep, freq, pres = batch.floats[3:, :, None]
        if batch.need_rep:
            # HF/SGLang: any token seen in prompt or output moves towards "less likely".
            seen = state.prompt_mask.index_select(0, rows) | (counts > 0)
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        if batch.need_freq:
            x = x - freq * counts
        if batch.need_pres:
            x = x - pres * (counts > 0)
        return x

    def _sample_rows(self, x: Tensor, batch: SamplingBatch, steps: Tensor) -> Tensor:
        # Greedy rows divide by 1 here; their result is replaced by the argmax later.
        temps, top_ps, min_ps = batch.floats[:3]
        top_ks, seeds = batch.ints
        x = x / torch.where(temps == 0, torch.ones_like(temps), temps).unsqueeze(1)
        vocab = x.shape[1]
        if batch.need_top_k or batch.need_top_p:
            # One descending sort; if every sampled row has a top-k, a top-k of the
            # largest k is enough and far cheaper than sorting the whole vocab.
            k = min(batch.max_top_k, vocab)
            vals, ids = torch.topk(x, k) if k < vocab else torch.sort(x, descending=True)
            if batch.need_top_k:
                pos = torch.arange(vals.shape[1], device=x.device)
                vals = vals.masked_fill(pos >= top_ks.unsqueeze(1), float("-inf"))
            if batch.need_top_p:
                # Top-p over the top-k survivors (HF order); keep a token while the mass
                # strictly before it is < p. Rows with p == 1 are exempt, since rounding
                # could push that prefix mass to 1.0 and cut their tail.
                probs = torch.softmax(vals, dim=-1)
                before = probs.cumsum(dim=-1) - probs
                p = top_ps.unsqueeze(1)
                vals = vals.masked_fill((before >= p) & (p < 1), float("-inf"))
            if batch.need_min_p:
                vals = _min_p_mask(vals, vals[:, :1], min_ps)
            pick = self._race(vals, seeds, steps, ids)
            return ids.gather(1, pick.unsqueeze(1)).squeeze(1)
        if batch.need_min_p:
            x = _min_p_mask(x, x.amax(dim=-1, keepdim=True), min_ps)
        ids = torch.arange(vocab, device=x.device)
        return self._race(x, seeds, steps, ids)

    @staticmethod
    def _logprobs(logits: Tensor, next_tokens: Tensor, batch: SamplingBatch) -> SampleOutput:
        if not batch.need_logprobs:
            return SampleOutput(next_tokens, None, None, None)
        logp = torch.log_softmax(logits.float(), dim=-1)  # raw logits, as vLLM by default
        chosen = logp.gather(1, next_tokens.unsqueeze(1)).squeeze(1)
        if batch.max_top_logprobs == 0:
            return SampleOutput(next_tokens, chosen, None, None)
        top_vals, top_ids = torch.topk(logp, batch.max_top_logprobs, dim=-1)  # sorted
        return SampleOutput(next_tokens, chosen, top_ids, top_vals)
