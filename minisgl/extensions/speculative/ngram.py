"""N-gram (prompt-lookup) drafting: propose the tokens that followed the latest earlier
occurrence of the request's last n tokens, for n from ``max_n`` down to ``min_n``.

Strong for code edits, retrieval and repetition, and free: no second model. The index is
updated incrementally as tokens arrive, so proposing costs O(max_n) per request per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minisgl.engine.engine import Engine
from minisgl.extensions.speculative.speculator import Proposal, SpeculatorBase
from minisgl.scheduler.request import Req, Row


@dataclass
class NgramDrafter:
    max_n: int = 3
    min_n: int = 1
    tokens: list[int] = field(default_factory=list)
    # n-gram -> position just after its latest occurrence that has a successor
    index: dict[tuple[int, ...], int] = field(default_factory=dict)
    missed: bool = False  # the last verified draft was rejected from its first token

    def extend(self, new_tokens: list[int]) -> None:
        for tok in new_tokens:
            self.tokens.append(tok)
            end = len(self.tokens) - 1  # the n-grams ending before this token now have a successor
            for n in range(self.min_n, self.max_n + 1):
                if end - n >= 0:
                    self.index[tuple(self.tokens[end - n : end])] = end

    def propose(self, k: int) -> list[int]:
        """Up to k draft tokens continuing the sequence (empty when nothing matches)."""
        toks = self.tokens
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            start = self.index.get(tuple(toks[len(toks) - n :]))
            if start is not None and start < len(toks):
                return toks[start : start + k]
        return []


class NgramSpeculator(SpeculatorBase):
    """Prompt lookup: drafts are known on the host when the step is planned."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.drafters: dict[int, NgramDrafter] = {}  # by request uid
        self.drafts: dict[int, list[int]] = {}  # this step's proposal, by request uid

    def plan(self, req: Req) -> int:
        k = self.budget(req)
        self.drafts[req.uid] = []
        if k <= 0:
            return 0
        drafter = self.drafters.setdefault(req.uid, NgramDrafter())
        drafter.extend(req.token_slice(len(drafter.tokens), req.num_known))
        # After a step that kept none of its drafts, probe with one: verifying two tokens
        # costs about what a plain decode does (CPU GEMMs of <= 2 rows, see
        # layers/cpu_linear.py), while K likely-wasted drafts widen the verify forward.
        draft = drafter.propose(1 if drafter.missed else k)
        self.drafts[req.uid] = draft
        return len(draft)

    def propose(self, rows: list[Row], verify: list[Row]) -> Proposal | None:
        drafts = [self.drafts[r.req.uid] for r in verify]
        if not drafts:
            return None
        padded = [d + [-1] * (self.k - len(d)) for d in drafts]
        return Proposal(self.engine.to_device(torch.tensor(padded, dtype=torch.long)), None)

    def verified(self, row: Row, accepted: int) -> None:
        self.drafters[row.req.uid].missed = accepted == 0

    def release(self, req: Req) -> None:
        self.drafters.pop(req.uid, None)
        self.drafts.pop(req.uid, None)
