"""The decode rows of a step: every running request whose prompt is computed feeds its newest
token (plus, when it speculates, draft tokens to verify). Every such row must fit: when the
pages run out, the policy's last requests are retracted until the rest fit."""

from __future__ import annotations

from minisgl.scheduler.kv_manager import KVManager
from minisgl.scheduler.plugins import Speculator
from minisgl.scheduler.preemption import Preemption
from minisgl.scheduler.request import Req, Row


class DecodeRows:
    def __init__(
        self,
        kv: KVManager,
        preemption: Preemption,
        speculator: Speculator | None,
        context_length: int,
    ) -> None:
        self.kv, self.preemption, self.speculator = kv, preemption, speculator
        self.context_length = context_length

    def split(self, running: list[Req]) -> tuple[list[Req], list[Req]]:
        """Running requests that decode next (by uid, so every TP rank orders them alike)
        and those with prompt tokens still to prefill. A request whose in-flight token is
        its last needs no further step. One pass with the properties inlined: this runs
        over every running request on every step."""
        decodes: list[Req] = []
        partial: list[Req] = []
        ctx = self.context_length
        for r in running:
            n_out = len(r.output_ids) + r.inflight
            n_tok = len(r.prompt_ids) + n_out
            pending = n_tok - r.kv_len
            if pending == 1:
                if r.inflight and (n_out >= r.params.max_new_tokens or n_tok >= ctx):
                    continue
                decodes.append(r)
            elif pending > 1:
                partial.append(r)
        decodes.sort(key=_uid)
        return decodes, partial

    def schedule(self, decodes: list[Req]) -> list[Row]:
        """One row per decode, its pages allocated; retracts what does not fit."""
        spec = self.speculator
        drafts = [spec.plan(r) if spec is not None else 0 for r in decodes]
        new_tokens = [1 + n for n in drafts]
        needs = self.kv.pages_needed(decodes, new_tokens)
        need = sum(needs)
        while decodes and need > self.kv.available_pages:
            i = self.preemption.victim(decodes)
            victim = decodes.pop(i)
            need -= needs.pop(i)
            new_tokens.pop(i)
            drafts.pop(i)
            self.preemption.retract(victim)
        ok = self.kv.allocate_batch(decodes, new_tokens, needs)
        assert ok, "decode allocation failed after the capacity check"
        return [Row(r, 1 + d, True, d) for r, d in zip(decodes, drafts)]


def _uid(req: Req) -> int:
    return req.uid
