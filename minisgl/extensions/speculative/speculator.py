"""The part of speculative decoding every drafting method shares: how many drafts a decode
row may verify, how the drafts enter the target's step (a `DeviceFill` placing them after
the row's last known token, a `LogitsHook` verifying them on the device, verify.py), and
what the verification's result means for the request (`accept`).

A method (ngram.py, draft_model.py) only says how many drafts a row gets (`plan`) and
proposes them at launch (`propose`: the drafts on the device, and the draft's distributions
when they are not deterministic)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from minisgl.engine.engine import Engine
from minisgl.engine.step import DeviceFill, LogitsHook
from minisgl.extensions.speculative.options import SpeculativeOptions
from minisgl.extensions.speculative.report import ACCEPTED, DRAFTED, VERIFY_STEPS
from minisgl.extensions.speculative.verify import verify_drafts
from minisgl.sampling_params import SamplingParams
from minisgl.scheduler.plugins import StepDrafts
from minisgl.scheduler.request import Req, Row


@dataclass(frozen=True)
class Proposal:
    drafts: torch.Tensor  # [S, K] on the device, one row per verifying row, -1 padded
    probs: torch.Tensor | None  # [S, K, V] the draft's distributions; None: one-hot drafts


class SpeculatorBase:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.k = engine.config.ext(SpeculativeOptions).speculative_num_steps
        self.totals: dict[str, int] = {}

    # ------------------------------------------------------------ the method's part
    def plan(self, req: Req) -> int:
        raise NotImplementedError

    def propose(self, rows: list[Row], verify: list[Row]) -> Proposal | None:
        """The drafts of the ``verify`` rows, at launch (``rows``: the whole step)."""
        raise NotImplementedError

    def verified(self, row: Row, accepted: int) -> None:
        """``accepted`` of the row's drafts were kept."""

    def cacheable(self, req: Req) -> int:
        return req.kv_len

    def release(self, req: Req) -> None:
        pass

    def check_integrity(self, live: list[Req]) -> None:
        pass

    # ------------------------------------------------------------ shared
    def check(self, params: SamplingParams) -> None:
        grammar = params.grammar
        if grammar is not None:
            raise ValueError(f"{grammar[0]} is not supported with speculative decoding")

    def budget(self, req: Req) -> int:
        """Drafts this decode may verify: 0 for the sampling modes that verification does not
        cover exactly (filters, penalties, logprobs), and never past max_tokens or the context."""
        p = req.params
        plain = p.top_k <= 0 and p.top_p == 1.0 and p.min_p == 0.0
        if not (p.is_greedy or plain) or p.uses_penalties or p.wants_logprobs:
            return 0
        room = min(
            p.max_new_tokens - req.num_generated - 1,
            self.engine.context_length - req.num_tokens - 1,
        )
        return max(0, min(self.k, room))

    def launch(self, rows: list[Row]) -> StepDrafts | None:
        verify = [r for r in rows if r.drafts]
        proposal = self.propose(rows, verify)
        if proposal is None or not verify:
            return None
        k = self.k
        index: list[int] = []  # k + 1 logits per row; short drafts repeat their last (ignored)
        fill: list[int] = []  # where each draft token goes in the flat input
        sources: list[int] = []
        first = 0
        i = 0
        for r in rows:
            if r.drafts:
                n = r.drafts
                index += [first + min(j, n) for j in range(k + 1)]
                fill += range(first + 1, first + 1 + n)
                sources += range(i * k, i * k + n)
                i += 1
            first += r.extend
        reqs = [r.req for r in verify]
        process = partial(
            verify_drafts,
            proposal.drafts,
            proposal.probs,
            [q.params.temperature if not q.params.is_greedy else 0.0 for q in reqs],
            [q.seed for q in reqs],
            [q.num_generated for q in reqs],
            self.engine.device,
        )
        return StepDrafts(DeviceFill(fill, sources, proposal.drafts), LogitsHook(index, process))

    def accept(self, rows: list[Row], results: list[Any]) -> list[list[int]]:
        tokens, counts = results
        emitted = []
        for row, toks, n in zip(rows, tokens, counts):
            req = row.req
            for key, value in ((VERIFY_STEPS, 1), (DRAFTED, row.drafts), (ACCEPTED, n - 1)):
                req.counters[key] = req.counters.get(key, 0) + value
                self.totals[key] = self.totals.get(key, 0) + value
            self.verified(row, n - 1)
            emitted.append(toks[:n])
        return emitted
