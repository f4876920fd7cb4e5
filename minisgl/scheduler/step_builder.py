"""Building a step's `StepInput` from its rows: every new token's id, position and KV slot,
the sampling rows and their parameters, and what plug-ins and prompt logprobs add."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.attention.base import BatchLayout
from minisgl.engine.engine import Engine
from minisgl.engine.sampler import SamplingBatch
from minisgl.engine.step import LogitsHook, PendingStep, SampleRequest, StepInput
from minisgl.scheduler.kv_manager import KVManager, ranges
from minisgl.scheduler.plugins import ConstraintBackend, Speculator
from minisgl.scheduler.prompt_logprobs import PromptLogprobs
from minisgl.scheduler.request import Req, Row


@dataclass
class Launched:
    """A step on the device: what to do with its results once they are read back."""

    rows: list[Row]
    sampled: list[Req]  # the requests of the rows that sample, in row order
    pending: PendingStep | None
    prompt_lp: PromptLogprobs | None  # its hook is the step's first
    drafts: list[Row]  # the rows that verify drafts; the speculator's hook comes last
    constrained: bool  # a sampling row has a constraint: read back before the next launch


class StepBuilder:
    def __init__(
        self,
        engine: Engine,
        kv: KVManager,
        speculator: Speculator | None,
        constraints: ConstraintBackend | None,
    ) -> None:
        self.engine, self.kv = engine, kv
        self.speculator, self.constraints = speculator, constraints
        self.prefill_tokens = 0  # tokens computed in prefill (for prefix-cache savings)
        # The last step's sampling rows, reused while the same requests sample.
        self._sampling: SamplingBatch | None = None
        self._sampling_key: tuple[tuple[int, ...], bool] = ((), False)

    def build(self, rows: list[Row]) -> tuple[StepInput, Launched]:
        """Nothing here waits for the device."""
        # The page table's new entries travel in the step's one staged copy, unless a draft
        # model reads the table before the step runs (it launches below).
        table = None
        if self.speculator is None:
            table = self.kv.take_updates()
        else:
            self.kv.flush()
        layout = BatchLayout(
            req_rows=[r.req.row for r in rows],
            prefix_lens=[r.req.kv_len for r in rows],
            extend_lens=[r.extend for r in rows],
            page_table=self.engine.page_table,
        )
        input_ids, from_previous, prompt_lp = self._inputs(rows)
        # Positions and KV slots of every new token, gathered without a per-token loop.
        row_idx, positions = ranges(layout.req_rows, layout.prefix_lens, layout.extend_lens)
        out_slots = self.kv.host_table[row_idx, positions]
        drafts = self.speculator.launch(rows) if self.speculator is not None else None
        hooks: list[LogitsHook] = []
        lp_hook = prompt_lp.hook(self.engine.device)
        if lp_hook is not None:
            hooks.append(lp_hook)
        if drafts is not None:
            hooks.append(drafts.hook)
        sample_idx = [i for i, r in enumerate(rows) if r.samples and not r.drafts]
        sampled = [rows[i].req for i in sample_idx]
        constrained = any(q.constraint is not None for q in sampled)
        sample = self._sample_request(sample_idx, sampled, constrained) if sampled else None
        step = StepInput(
            layout,
            input_ids,
            positions,
            out_slots,
            from_previous,
            drafts.fill if drafts is not None else None,
            sample,
            tuple(hooks),
            table,
        )
        verify = [r for r in rows if r.drafts]
        lp = prompt_lp if lp_hook is not None else None
        return step, Launched(rows, sampled, None, lp, verify, constrained)

    def _inputs(self, rows: list[Row]) -> tuple[list[int], list[tuple[int, int]], PromptLogprobs]:
        input_ids: list[int] = []
        from_previous: list[tuple[int, int]] = []  # (flat position, page-table row)
        prompt_lp = PromptLogprobs()
        for r in rows:
            req, start, end = r.req, r.req.kv_len, r.req.kv_len + r.extend
            if r.extend == 1 and req.output_ids and req.params.prompt_logprobs is None:
                # Decode (the common row): the one input is the newest token, known or not.
                if req.inflight:
                    from_previous.append((len(input_ids), req.row))
                    input_ids.append(0)
                else:
                    input_ids.append(req.output_ids[-1])
                continue
            if req.params.prompt_logprobs is not None:
                prompt_lp.add(req, start, end, len(input_ids) - start)
            if r.drafts:  # the known last token, then places for the drafts (filled on device)
                input_ids += req.token_slice(start, start + 1) + [0] * r.drafts
                continue
            known_end = min(end, req.num_known)
            input_ids += req.token_slice(start, known_end)
            if end > known_end:  # the last token was sampled by the step still in flight
                from_previous.append((len(input_ids), req.row))
                input_ids.append(0)
            if r.extend > 1 or req.num_generated == 0:
                self.prefill_tokens += r.extend
        return input_ids, from_previous, prompt_lp

    def _sample_request(
        self, sample_idx: list[int], sampled: list[Req], constrained: bool
    ) -> SampleRequest:
        key = tuple(q.uid for q in sampled)
        if key != self._sampling_key[0] or self._sampling is None:
            # Rebuilt only when the rows change: a decode batch keeps its members for many steps.
            self._sampling = SamplingBatch.build(
                [q.params for q in sampled], [q.seed for q in sampled]
            )
            self._sampling_key = (key, any(q.params.uses_penalties for q in sampled))
        allowed = None
        if constrained and self.constraints is not None:
            allowed = self.constraints.bitmask([q.constraint for q in sampled])
        return SampleRequest(
            rows=sample_idx,
            table_rows=[q.row for q in sampled],
            steps=[q.num_generated for q in sampled],
            params=self._sampling,
            use_penalties=self._sampling_key[1],
            allowed=allowed,
        )
