"""What an extension may add to the scheduler, and where it registers.

Two kinds of plug-in, each behind one Protocol and one registry:

- a `Speculator` (speculative decoding): before a decode row is scheduled it says how many
  draft tokens the row verifies; at launch it adds the drafts to the step (a `DeviceFill`
  and a `LogitsHook` that verifies them on the device); after the step it says which of the
  row's tokens were accepted. The scheduler makes those three calls and knows nothing else
  about how drafts are made or checked.
- a `ConstraintBackend` (structured output): a request's constraint (a grammar, say) is
  started when the request arrives, fills its row of the allowed-token bitmask before every
  step, and sees every token the row samples; it may end the request.

A factory per kind is registered by the extension at import; the scheduler asks the
factories for an instance (None: the extension does not apply to this configuration).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from minisgl.config import EngineConfig
from minisgl.sampling_params import SamplingParams
from minisgl.scheduler.request import Req, Row

if TYPE_CHECKING:  # the registries are light: an extension registers without loading torch
    import torch

    from minisgl.engine.engine import Engine
    from minisgl.engine.step import DeviceFill, LogitsHook
    from minisgl.scheduler.kv_manager import KVManager


@dataclass(frozen=True)
class StepDrafts:
    """What a speculator adds to a step: where its draft tokens come from, and the hook
    whose results `Speculator.accept` reads after the step."""

    fill: DeviceFill | None
    hook: LogitsHook


class Speculator(Protocol):
    totals: dict[str, int]  # the scheduler's totals over the run, where it adds its own

    def check(self, params: SamplingParams) -> None:
        """ValueError naming the field if a request with ``params`` cannot be served."""

    def plan(self, req: Req) -> int:
        """How many draft tokens the decode row of ``req`` verifies this step (0: plain)."""

    def launch(self, rows: list[Row]) -> StepDrafts | None:
        """At launch, before the target's forward, with every row of the step: the drafts of
        the rows that verify some (None if none does)."""

    def accept(self, rows: list[Row], results: list[Any]) -> list[list[int]]:
        """After the step, from the hook's results: for each row that verified drafts (in
        order), the tokens it emits (the accepted drafts, then the target's own token)."""

    def cacheable(self, req: Req) -> int:
        """How many leading tokens of ``req`` may enter the prefix cache (their K/V is
        complete for whatever else the speculator keeps beside the target's)."""

    def release(self, req: Req) -> None:
        """``req`` is finished: forget it."""

    def check_integrity(self, live: list[Req]) -> None:
        """AssertionError if what it keeps for the live requests is inconsistent."""


class ConstraintBackend(Protocol):
    def start(self, params: SamplingParams, prompt_ids: Sequence[int]) -> object | None:
        """The constraint state of a new request (None: unconstrained); ValueError naming the
        field if the constraint cannot be compiled."""

    def bitmask(self, states: Sequence[object | None]) -> torch.Tensor | None:
        """int32 [len(states), ceil(V / 32)]: the tokens each row may sample next (every token
        for None or a state not constraining yet); None if no row is constrained now."""

    def advance(self, req: Req, token: int) -> bool:
        """``req`` sampled ``token``: advance its constraint; True when it is complete."""


SpeculatorFactory = Callable[["Engine", "KVManager"], "Speculator | None"]
ConstraintFactory = Callable[["Engine", Callable[[], object]], ConstraintBackend]

_speculators: list[SpeculatorFactory] = []
_constraints: list[ConstraintFactory] = []


def register_speculator(factory: SpeculatorFactory) -> None:
    _speculators.append(factory)


def register_constraints(factory: ConstraintFactory) -> None:
    _constraints.append(factory)


def make_speculator(engine: Engine, kv: KVManager) -> Speculator | None:
    for factory in _speculators:
        spec = factory(engine, kv)
        if spec is not None:
            return spec
    return None


def make_constraints(engine: Engine, tokenizer: Callable[[], object]) -> ConstraintBackend | None:
    """``tokenizer`` loads the model's tokenizer (lazily: only a constrained request needs it)."""
    return _constraints[0](engine, tokenizer) if _constraints else None


# Fields an extension derives from a request's counters (Req.counters) for its result:
# given the engine's configuration and the counters, e.g. {"spec_accept_length": 4.0}.
CounterReport = Callable[[EngineConfig, dict[str, int]], dict[str, object]]
_reports: list[CounterReport] = []


def register_counter_report(report: CounterReport) -> None:
    _reports.append(report)


def counter_fields(config: EngineConfig, counters: dict[str, int]) -> dict[str, object]:
    fields: dict[str, object] = {}
    for report in _reports:
        fields.update(report(config, counters))
    return fields
