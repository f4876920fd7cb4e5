"""Batched on-device sampling: penalties, temperature, top-k/top-p/min-p, logprobs.

`Sampler.sample` never syncs with the host: every branch is decided by host flags that
`SamplingBatch.build` computed. Noise is counter based, a hash of (seed, step, vocab id),
so a request's tokens depend only on its own seed and output position, not on the rest
of the batch. The exponential race argmax(logit/T - log E_v), E_v ~ Exp(1), draws v with
probability softmax(logit/T)_v; restricted to the tokens that survive filtering, it draws
from the renormalised distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from minisgl.sampling_params import SamplingParams

_U64 = (1 << 64) - 1
# Stands in for "top-k off" when the vocab size is unknown at build time; the
# sampler never masks a position >= the row's k, so any k >= V behaves as off.
TOP_K_OFF = 1 << 30


def _i64(c: int) -> int:
    """Reinterpret a uint64 constant as the int64 with the same bits."""
    c &= _U64
    return c - (1 << 64) if c >= 1 << 63 else c


_GAMMA = _i64(0x9E3779B97F4A7C15)  # splitmix64 increment (odd, golden ratio)
_MUL1 = _i64(0xBF58476D1CE4E5B9)
_MUL2 = _i64(0x94D049BB133111EB)


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


def uniform_noise(seeds: Tensor, steps: Tensor, ids: Tensor) -> Tensor:
    """Uniform (0, 1) float32 noise u[b, j] = hash(seeds[b], steps[b], ids[b, j]).

    `ids` is [B, N] (or [N], broadcast over rows). Only 31 bits are used, spaced 2^-31,
    which is ample for float32 and keeps the values strictly inside (0, 1).
    """
    z = _mix64_(row_keys(seeds, steps).unsqueeze(1) + (ids.to(torch.int64) + 1) * _GAMMA)
    u = _shr(z, 33).to(torch.float32).mul_(2.0**-31).add_(2.0**-32)
    # k * 2^-31 rounds up to 1.0 in float32 for the top few k; keep the log finite.
    return u.clamp_(max=1.0 - 2.0**-24)


def gumbel_noise(seeds: Tensor, steps: Tensor, ids: Tensor) -> Tensor:
    """-log(E) with E = -log1p(-u) ~ Exp(1); log1p keeps small E (the winners) precise."""
    return uniform_noise(seeds, steps, ids).neg_().log1p_().neg_().log_().neg_()


class PenaltyState:
    """Per-slot output-token counts and prompt-token masks for the penalties.

    The [max_slots, V] tensors appear at the first `reset_slot`, so a server where nobody
    uses penalties pays nothing (`add_tokens` is a no-op until then). Stale slots of
    requests without penalties are harmless: their penalties are neutral.
    """

    def __init__(self, max_slots: int, vocab_size: int, device: torch.device | str) -> None:
        self.max_slots = max_slots
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.output_counts: Tensor | None = None  # [max_slots, V] int32
        self.prompt_mask: Tensor | None = None  # [max_slots, V] bool

    @property
    def allocated(self) -> bool:
        return self.output_counts is not None

    def reset_slot(self, slot: int, prompt_ids: Tensor, output_ids: Tensor | None = None) -> None:
        """Start a request in `slot`; `output_ids` restores counts after a recompute."""
        shape, dev = (self.max_slots, self.vocab_size), self.device
        if self.output_counts is None:
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=dev)
        if self.prompt_mask is None:
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=dev)
        counts, prompt = self.output_counts[slot], self.prompt_mask[slot]
        counts.zero_()
        prompt.zero_().index_fill_(0, prompt_ids.to(dev, torch.int64), True)
        if output_ids is not None:
            ids = output_ids.to(dev, torch.int64)
            counts.scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def add_tokens(self, slots: Tensor, tokens: Tensor) -> None:
        """counts[slots[i], tokens[i]] += 1, on device; repeated (slot, token) pairs add up."""
        if self.output_counts is None:
            return
        flat = slots.to(torch.int64) * self.vocab_size + tokens.to(torch.int64)
        ones = torch.ones_like(flat, dtype=torch.int32)
        self.output_counts.view(-1).scatter_add_(0, flat, ones)


@dataclass
class SamplingBatch:
    """Per-row sampling tensors on the device plus host flags that decide the work."""

    temperatures: Tensor  # [B] float32, 0 for greedy rows
    top_ps: Tensor  # [B] float32
    top_ks: Tensor  # [B] int64, >= V (or TOP_K_OFF) when off
    min_ps: Tensor  # [B] float32
    seeds: Tensor  # [B] int64
    steps: Tensor  # [B] int64, output position of the token being sampled
    repetition_penalties: Tensor | None  # [B] float32; None when no row uses it
    frequency_penalties: Tensor | None
    presence_penalties: Tensor | None
    all_greedy: bool
    any_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    max_top_k: int  # largest k over sampled rows (TOP_K_OFF/V if any is off)
    need_logprobs: bool
    max_top_logprobs: int

    @property
    def need_penalties(self) -> bool:
        pens = (self.repetition_penalties, self.frequency_penalties, self.presence_penalties)
        return any(t is not None for t in pens)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        steps: Sequence[int],
        device: torch.device | str,
        vocab_size: int | None = None,
    ) -> SamplingBatch:
        if not (len(params) == len(seeds) == len(steps)):
            raise ValueError(f"lengths differ: {len(params)=}, {len(seeds)=}, {len(steps)=}")
        off = TOP_K_OFF if vocab_size is None else vocab_size
        temps, top_ps, min_ps, top_ks = [], [], [], []
        for p in params:
            # Greedy rows get neutral filters so they never force a sort on the others.
            g = p.is_greedy
            temps.append(0.0 if g else p.temperature)
            top_ps.append(1.0 if g else p.top_p)
            min_ps.append(0.0 if g else p.min_p)
            top_ks.append(off if g or p.top_k <= 0 else min(p.top_k, off))
        reps = [p.repetition_penalty for p in params]
        freqs = [p.frequency_penalty for p in params]
        press = [p.presence_penalty for p in params]
        sampled = [j for j, t in enumerate(temps) if t != 0.0]

        # Two packed host tensors -> two H2D copies per step instead of nine.
        dev = torch.device(device)
        pin = dev.type == "cuda" and torch.cuda.is_available()
        f_host = torch.tensor([temps, top_ps, min_ps, reps, freqs, press], dtype=torch.float32)
        i_host = torch.tensor([top_ks, [_i64(s) for s in seeds], list(steps)], dtype=torch.int64)
        if pin:
            f_host, i_host = f_host.pin_memory(), i_host.pin_memory()
        f, i = f_host.to(dev, non_blocking=True), i_host.to(dev, non_blocking=True)
        return cls(
            temperatures=f[0],
            top_ps=f[1],
            top_ks=i[0],
            min_ps=f[2],
            seeds=i[1],
            steps=i[2],
            repetition_penalties=f[3] if any(r != 1.0 for r in reps) else None,
            frequency_penalties=f[4] if any(x != 0.0 for x in freqs) else None,
            presence_penalties=f[5] if any(x != 0.0 for x in press) else None,
            all_greedy=not sampled,
            any_greedy=len(sampled) < len(params),
            need_top_k=any(top_ks[j] < off for j in sampled),
            need_top_p=any(top_ps[j] < 1.0 for j in sampled),
            need_min_p=any(min_ps[j] > 0.0 for j in sampled),
            max_top_k=max((top_ks[j] for j in sampled), default=off),
            need_logprobs=any(p.wants_logprobs for p in params),
            max_top_logprobs=max((p.top_logprobs for p in params), default=0),
        )


@dataclass
class SampleOutput:
    next_tokens: Tensor  # [B] int64
    chosen_logprobs: Tensor | None  # [B] float32, for every row when any row asked
    top_logprob_ids: Tensor | None  # [B, K] int64, K = max_top_logprobs, sorted descending
    top_logprobs: Tensor | None  # [B, K] float32


class Sampler:
    def sample(
        self,
        logits: Tensor,
        batch: SamplingBatch,
        penalty_state: PenaltyState | None = None,
        penalty_rows: Tensor | None = None,
    ) -> SampleOutput:
        """Pick one token per row of `logits` [B, V]. `penalty_rows[b]` is row b's slot
        in `penalty_state` (defaults to slot == row)."""
        x = logits
        if batch.need_penalties:
            x = self._apply_penalties(x.float(), batch, penalty_state, penalty_rows)
        if batch.all_greedy:
            next_tokens = x.argmax(dim=-1)  # with no penalties, the whole step is one kernel
        else:
            next_tokens = self._sample_rows(x.float(), batch)
            if batch.any_greedy:
                greedy = x.argmax(dim=-1)
                next_tokens = torch.where(batch.temperatures == 0, greedy, next_tokens)
        return self._logprobs(logits, next_tokens, batch)

    @staticmethod
    def _apply_penalties(
        x: Tensor, batch: SamplingBatch, state: PenaltyState | None, rows: Tensor | None
    ) -> Tensor:
        if state is None or state.output_counts is None or state.prompt_mask is None:
            raise ValueError("a row uses penalties but no allocated PenaltyState was passed")
        rows = torch.arange(x.shape[0], device=x.device) if rows is None else rows
        counts = state.output_counts.index_select(0, rows)
        rep = batch.repetition_penalties
        if rep is not None:
            # HF/SGLang: any token seen in prompt or output moves towards "less likely".
            seen = state.prompt_mask.index_select(0, rows) | (counts > 0)
            p = rep.unsqueeze(1)
            x = torch.where(seen, torch.where(x > 0, x / p, x * p), x)
        freq, pres = batch.frequency_penalties, batch.presence_penalties
        if freq is not None:
            x = x - freq.unsqueeze(1) * counts
        if pres is not None:
            x = x - pres.unsqueeze(1) * (counts > 0)
        return x

    @staticmethod
    def _sample_rows(x: Tensor, batch: SamplingBatch) -> Tensor:
        # Greedy rows divide by 1 here; their result is replaced by the argmax later.
        temps = batch.temperatures
        x = x / torch.where(temps == 0, torch.ones_like(temps), temps).unsqueeze(1)
        vocab = x.shape[1]
        if batch.need_top_k or batch.need_top_p:
            # One descending sort; if every sampled row has a top-k, a top-k of the
            # largest k is enough and far cheaper than sorting the whole vocab.
            k = min(batch.max_top_k, vocab)
            vals, ids = torch.topk(x, k) if k < vocab else torch.sort(x, descending=True)
            if batch.need_top_k:
                pos = torch.arange(vals.shape[1], device=x.device)
                vals = vals.masked_fill(pos >= batch.top_ks.unsqueeze(1), float("-inf"))
            if batch.need_top_p:
                # Top-p over the top-k survivors (HF order); keep a token while the mass
                # strictly before it is < p. Rows with p == 1 are exempt, since rounding
                # could push that prefix mass to 1.0 and cut their tail.
                probs = torch.softmax(vals, dim=-1)
                before = probs.cumsum(dim=-1) - probs
                top_ps = batch.top_ps.unsqueeze(1)
                vals = vals.masked_fill((before >= top_ps) & (top_ps < 1), float("-inf"))
            if batch.need_min_p:
                vals = Sampler._min_p_mask(vals, vals[:, :1], batch.min_ps)
            scores = vals + gumbel_noise(batch.seeds, batch.steps, ids)
            return ids.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1)
        if batch.need_min_p:
            x = Sampler._min_p_mask(x, x.amax(dim=-1, keepdim=True), batch.min_ps)
        ids = torch.arange(vocab, device=x.device)
        return (x + gumbel_noise(batch.seeds, batch.steps, ids)).argmax(dim=-1)

    @staticmethod
    def _min_p_mask(x: Tensor, row_max: Tensor, min_ps: Tensor) -> Tensor:
        # p_v < min_p * p_max  <=>  logit_v < logit_max + log(min_p), no softmax needed;
        # min_p == 0 gives -inf, which masks nothing.
        threshold = row_max + torch.log(min_ps).unsqueeze(1)
        return x.masked_fill(x < threshold, float("-inf"))

    @staticmethod
    def _logprobs(logits: Tensor, next_tokens: Tensor, batch: SamplingBatch) -> SampleOutput:
        if not batch.need_logprobs:
            return SampleOutput(next_tokens, None, None, None)
        # Raw logits, before penalties and temperature (vLLM's default).
        logp = torch.log_softmax(logits.float(), dim=-1)
        chosen = logp.gather(1, next_tokens.unsqueeze(1)).squeeze(1)
        if batch.max_top_logprobs == 0:
            return SampleOutput(next_tokens, chosen, None, None)
        top_vals, top_ids = torch.topk(logp, batch.max_top_logprobs, dim=-1, sorted=True)
        return SampleOutput(next_tokens, chosen, top_ids, top_vals)
