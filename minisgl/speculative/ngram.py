"""N-gram (prompt-lookup) drafting: propose the tokens that followed the latest earlier
occurrence of the request's last n tokens, for n from ``max_n`` down to ``min_n``.

Strong for code edits, retrieval and repetition, and free: no second model. The index is
updated incrementally as tokens arrive, so proposing costs O(max_n) per request per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
