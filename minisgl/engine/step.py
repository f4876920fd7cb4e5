"""What the scheduler hands the engine for one step, and what comes back.

The scheduler builds a `StepInput` on the host; `Engine.forward` launches the whole step
without waiting for the device and returns a `PendingStep`, whose `result()` is the one
host sync of the step (a `StepOutput`). Extensions add work to a step only through the two
hooks here: `DeviceFill` (input tokens that exist only on the device, e.g. a draft model's
proposals) and `LogitsHook` (logits at extra positions, turned into tensors on the device and
copied back with the samples, e.g. verifying drafts, or the prompt's logprobs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from minisgl.attention.base import BatchLayout
from minisgl.engine.sampler import SampleOutput, SamplingBatch


@dataclass(frozen=True)
class SampleRequest:
    """The rows that sample a token this step (each at its row's last new token)."""

    rows: list[int]  # batch rows, in order
    table_rows: list[int]  # their page-table rows: index `last_tokens` and penalty state
    steps: list[int]  # the output position each row samples (the noise's counter)
    params: SamplingBatch  # on the host, reused while the same requests sample
    use_penalties: bool = False
    # int32 [rows, ceil(V / 32)] on the host: bit v of row i set = token v allowed (None: all).
    allowed: torch.Tensor | None = None


@dataclass(frozen=True)
class DeviceFill:
    """Input tokens read on the device: ``values.view(-1)[sources[i]]`` is the input at flat
    position ``positions[i]``."""

    positions: list[int]
    sources: list[int]
    values: torch.Tensor


@dataclass(frozen=True)
class LogitsHook:
    """Logits at flat positions ``index`` (model dtype), processed on the device by
    ``process``; its tensors come back to the host with the step's samples, as lists."""

    index: list[int]
    process: Callable[[torch.Tensor], list[torch.Tensor | None]]


@dataclass(frozen=True)
class TableUpdate:
    """Page-table entries the scheduler changed on its host copy since the last step
    (int64, host): the engine writes ``table[rows[i], cols[i]] = values[i]`` on the device,
    in the step's one staged copy, before the step reads the table."""

    rows: torch.Tensor
    cols: torch.Tensor
    values: torch.Tensor


@dataclass(frozen=True)
class StepInput:
    layout: BatchLayout
    input_ids: list[int]  # every new token, rows back to back (placeholders where filled)
    positions: torch.Tensor  # [T] int64, host
    out_slots: torch.Tensor  # [T] int64, host: the KV slot of each new token
    # (flat position, page-table row): the input is the token that row sampled last step,
    # read on the device, so a step can launch before the previous one is read back.
    from_previous: list[tuple[int, int]] = field(default_factory=list)
    fill: DeviceFill | None = None
    sample: SampleRequest | None = None
    hooks: tuple[LogitsHook, ...] = ()
    table: TableUpdate | None = None


@dataclass
class StepOutput:
    """A step's results on the host."""

    tokens: list[int]  # one per sampling row
    chosen_logprobs: list[float] | None  # when any sampling row asked for logprobs
    top_ids: list[list[int]] | None  # [rows, K] when any asked for top logprobs
    top_logprobs: list[list[float]] | None
    # Per hook, what its process returned, as nested lists (None where it returned None).
    hook_results: list[list[Any]]


class PendingStep:
    """A launched step's outputs on their way to the host (non-blocking copies + an event)."""

    def __init__(self, sample: SampleOutput | None, hooks: list[list[torch.Tensor | None]]) -> None:
        tensors: list[torch.Tensor | None] = [None] * 4
        if sample is not None:
            tensors = [sample.next_tokens, sample.chosen_logprobs]
            tensors += [sample.top_logprob_ids, sample.top_logprobs]
        self.sizes = [len(h) for h in hooks]
        tensors += [t for h in hooks for t in h]
        self.event: torch.cuda.Event | None = None
        on_cuda = next((t for t in tensors if t is not None and t.device.type == "cuda"), None)
        if on_cuda is not None:
            tensors = [t.to("cpu", non_blocking=True) if t is not None else None for t in tensors]
            self.event = torch.cuda.Event()
            # The stream by device index: a bare record() looks the current device up first.
            self.event.record(torch.cuda.current_stream(on_cuda.device.index))
        self.tensors = tensors

    def result(self) -> StepOutput:
        """Wait for the copies (the step's one host sync) and return the values."""
        if self.event is not None:
            self.event.synchronize()
        host = [t.tolist() if t is not None else None for t in self.tensors]
        hooks, at = [], 4
        for n in self.sizes:
            hooks.append(host[at : at + n])
            at += n
        return StepOutput(host[0] or [], host[1], host[2], host[3], hooks)
