"""Speculative decoding: a cheap drafter proposes K tokens per decode row, the target model
verifies them in one forward, and rejection sampling keeps the target's distribution
exactly (greedy rows keep exactly the drafts equal to the target's argmax).

Drafters: n-gram prompt lookup (ngram.py) or a small draft model with the target's
vocabulary (draft_model.py). It plugs into the scheduler as a `Speculator`
(minisgl/scheduler/plugins.py), adds its ``--speculative-*`` options, reserves the draft
model's memory before the KV pool is sized, and reports per-request figures. Importing this
package stays light (no torch): the API server loads it for its options."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minisgl.config import EngineConfig, OptionGroup, register_options
from minisgl.engine.plugins import register_memory_reserve
from minisgl.extensions.speculative import server
from minisgl.extensions.speculative.options import SpeculativeOptions, check
from minisgl.extensions.speculative.report import ACCEPTED, DRAFTED, VERIFY_STEPS, spec_report
from minisgl.scheduler.plugins import register_counter_report, register_speculator

if TYPE_CHECKING:
    import torch

    from minisgl.engine.engine import Engine
    from minisgl.scheduler.kv_manager import KVManager
    from minisgl.scheduler.plugins import Speculator


def make_speculator(engine: Engine, kv: KVManager) -> Speculator | None:
    algorithm = engine.config.ext(SpeculativeOptions).speculative_algorithm
    if algorithm == "ngram":
        from minisgl.extensions.speculative.ngram import NgramSpeculator

        return NgramSpeculator(engine)
    if algorithm == "draft":
        from minisgl.extensions.speculative.draft_model import DraftModelSpeculator

        return DraftModelSpeculator(engine, kv)
    return None


def reserve(config: EngineConfig, dtype: torch.dtype, kv_dtype: torch.dtype) -> tuple[int, int]:
    if config.ext(SpeculativeOptions).speculative_draft_model is None:
        return 0, 0
    from minisgl.extensions.speculative.draft_model import draft_footprint

    return draft_footprint(config, dtype, kv_dtype)


def report(config: EngineConfig, counters: dict[str, int]) -> dict[str, object]:
    if config.ext(SpeculativeOptions).speculative_algorithm is None:
        return {}
    figures = (counters.get(VERIFY_STEPS, 0), counters.get(DRAFTED, 0), counters.get(ACCEPTED, 0))
    return spec_report(*figures)


register_options(OptionGroup("speculative decoding", SpeculativeOptions, check))
register_speculator(make_speculator)
register_memory_reserve(reserve)
register_counter_report(report)
server.register()
