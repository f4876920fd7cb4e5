"""Speculative decoding's options (flags ``--speculative-*``, keywords of ``LLM``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from minisgl.config import EngineConfig, option


@dataclass(frozen=True)
class SpeculativeOptions:
    # "ngram" drafts from the request's own tokens (prompt lookup); "draft" runs a small
    # draft model with the same vocabulary (implied by a draft model).
    speculative_algorithm: str | None = option(
        None,
        "ngram | draft (default: draft when a draft model is given)",
        choices=("ngram", "draft"),
    )
    speculative_num_steps: int = option(4, "draft tokens proposed per request per step", low=1)
    speculative_draft_model: str | None = option(
        None, "draft model (same vocabulary) for --speculative-algorithm draft"
    )

    def __post_init__(self) -> None:
        if self.speculative_draft_model is not None and self.speculative_algorithm is None:
            object.__setattr__(self, "speculative_algorithm", "draft")


def check(config: EngineConfig) -> None:
    o = config.ext(SpeculativeOptions)
    draft_iff = (o.speculative_algorithm == "draft") == (o.speculative_draft_model is not None)
    rules = [
        (
            "speculative_draft_model",
            draft_iff,
            "required with speculative_algorithm=draft, and only then",
        ),
        (
            "speculative_draft_model",
            o.speculative_draft_model is None or config.tp_size == 1,
            "not supported with tp_size > 1 yet",
        ),
        ("speculative_num_steps", o.speculative_num_steps <= 16, "in [1, 16]"),
    ]
    for name, ok, want in rules:
        if not ok:
            raise ValueError(f"{name}={getattr(o, name)!r} is invalid: {want}")


def without_speculation(config: EngineConfig) -> EngineConfig:
    """``config`` with speculation off (for the draft model's own engine)."""
    others = tuple(e for e in config.extensions if not isinstance(e, SpeculativeOptions))
    return dataclasses.replace(config, extensions=(*others, SpeculativeOptions()))
