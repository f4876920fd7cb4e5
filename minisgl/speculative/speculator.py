"""What the scheduler asks of a speculation method, and the n-gram method.

Per step: ``plan`` decides, for each decode row, how many draft tokens it will verify (the
scheduler allocates KV for them); ``propose`` runs at launch, with every row of the batch,
and returns the draft tokens of the speculating rows; ``verified`` is told how many of a
row's drafts were kept.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from minisgl.engine.engine import Engine
from minisgl.scheduler.request import Req
from minisgl.speculative.ngram import NgramDrafter


@dataclass
class BatchRow:
    req: Req
    extend: int  # tokens the target computes for the row in this step
    spec: bool  # a decode row verifying req.num_draft drafts


@dataclass
class Proposal:
    drafts: torch.Tensor  # [S, K] on the device, one row per speculating row, -1 padded
    probs: torch.Tensor | None  # [S, K, V] the draft's distributions; None: one-hot drafts


class Speculator(ABC):
    """Base: the draft budget shared by every method."""

    def __init__(self, engine: Engine, k: int) -> None:
        self.engine = engine
        self.k = k

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

    @abstractmethod
    def plan(self, req: Req) -> int:
        """Drafts the decode row of ``req`` verifies in this step (0: a plain decode)."""

    @abstractmethod
    def propose(self, rows: list[BatchRow]) -> Proposal | None:
        """At launch, before the target's forward: the drafts of the speculating rows."""

    @abstractmethod
    def verified(self, req: Req, accepted: int) -> None:
        """``accepted`` of the row's req.num_draft drafts were kept (KV already rolled back)."""


class NgramSpeculator(Speculator):
    """Prompt lookup: drafts are known on the host when the step is planned."""

    def plan(self, req: Req) -> int:
        k = self.budget(req)
        req.draft = []
        if k <= 0:
            return 0
        if req.drafter is None:
            req.drafter = NgramDrafter()
        drafter = req.drafter
        assert isinstance(drafter, NgramDrafter)
        drafter.extend(req.token_slice(len(drafter.tokens), req.num_known))
        # After a step that kept none of its drafts, probe with one: verifying two tokens
        # costs about what a plain decode does (CPU GEMMs of <= 2 rows, see
        # layers/cpu_linear.py), while K likely-wasted drafts widen the verify forward.
        req.draft = drafter.propose(1 if drafter.missed else k)
        return len(req.draft)

    def verified(self, req: Req, accepted: int) -> None:
        assert isinstance(req.drafter, NgramDrafter)
        req.drafter.missed = accepted == 0

    def propose(self, rows: list[BatchRow]) -> Proposal | None:
        drafts = [r.req.draft + [-1] * (self.k - len(r.req.draft)) for r in rows if r.spec]
        if not drafts:
            return None
        return Proposal(self.engine.to_device(torch.tensor(drafts, dtype=torch.long)), None)


def make_speculator(engine: Engine, host_table: torch.Tensor) -> Speculator | None:
    cfg = engine.config
    if cfg.speculative_algorithm == "ngram":
        return NgramSpeculator(engine, cfg.speculative_num_steps)
    if cfg.speculative_algorithm == "draft":
        from minisgl.speculative.draft_model import DraftModelSpeculator

        return DraftModelSpeculator(engine, cfg.speculative_num_steps, host_table)
    return None
