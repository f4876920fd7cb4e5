"""A step's results, read back: each sampling row's token (and logprobs) joins its request,
stop conditions and constraints are checked, and rows that verified drafts keep what the
speculator accepted."""

from __future__ import annotations

from collections.abc import Callable

from minisgl.engine.step import StepOutput
from minisgl.scheduler.plugins import ConstraintBackend, Speculator
from minisgl.scheduler.request import Req, Row
from minisgl.scheduler.step_builder import Launched
from minisgl.scheduler.stop import StopChecker


class Results:
    def __init__(
        self,
        stop_checker: StopChecker,
        constraints: ConstraintBackend | None,
        speculator: Speculator | None,
        context_length: int,
        finish: Callable[[Req, str], None],
    ) -> None:
        self.stop_checker, self.constraints, self.speculator = stop_checker, constraints, speculator
        self.context_length = context_length
        self.finish = finish  # ends a request: its pages go back

    def apply(self, launched: Launched, out: StepOutput) -> None:
        if launched.prompt_lp is not None:
            launched.prompt_lp.store(out.hook_results[0])
        if launched.drafts:
            self._accept_drafts(launched.drafts, out.hook_results[-1])
        for i, req in enumerate(launched.sampled):
            req.inflight -= 1
            if req.finished:
                continue  # aborted while its batch was in flight: the sample is dropped
            self._append(req, out, i)

    def _append(self, req: Req, out: StepOutput, i: int) -> None:
        token = out.tokens[i]
        req.output_ids.append(token)
        p = req.params
        if p.logprobs and out.chosen_logprobs is not None:
            req.output_logprobs.append(out.chosen_logprobs[i])
        if p.top_logprobs and out.top_ids is not None and out.top_logprobs is not None:
            k = p.top_logprobs
            req.output_top_logprobs.append(list(zip(out.top_ids[i][:k], out.top_logprobs[i][:k])))
        reason = self.stop_checker.check(req, self.context_length)
        if req.constraint is not None and self.constraints is not None:
            if self.constraints.advance(req, token) and reason is None:
                reason = "stop"  # the constraint is complete: nothing else may follow
        if reason is not None:
            self.finish(req, reason)

    def _accept_drafts(self, rows: list[Row], results: list[object]) -> None:
        """Rows that verified drafts emit the accepted ones and the target's own token; only
        verified tokens keep their K/V."""
        assert self.speculator is not None
        for row, tokens in zip(rows, self.speculator.accept(rows, results)):
            req, reason = row.req, None
            old_kv = req.kv_len - 1 - row.drafts
            for tok in tokens:
                req.output_ids.append(tok)
                reason = self.stop_checker.check(req, self.context_length)
                if reason is not None:
                    break
            req.kv_len = min(old_kv + len(tokens), req.num_known - 1)
            if reason is not None:
                self.finish(req, reason)
