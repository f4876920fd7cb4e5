"""Finish conditions: EOS, stop token ids, stop strings, max_tokens, context length."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from minisgl.scheduler.request import Req


class StopChecker:
    def __init__(self, eos_ids: Sequence[int], decode: Callable[[list[int]], str] | None) -> None:
        self.eos_ids = frozenset(eos_ids)
        self.decode = decode

    def check(self, req: Req, context_length: int) -> str | None:
        """Returns the finish reason after the request's newest token, or None to go on."""
        p = req.params
        tok = req.output_ids[-1]
        n_out = len(req.output_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and tok in self.eos_ids:
                req.matched_stop = tok
                return "stop"
            if p.stop_token_ids and tok in p.stop_token_ids:
                req.matched_stop = tok
                return "stop"
            if p.stop and self.decode is not None:
                stops = p.stop if isinstance(p.stop, (list, tuple)) else [p.stop]
                longest = max(len(s) for s in stops)
                # A stop string ends in the newest tokens; decode just enough of the tail.
                tail = self.decode(req.output_ids[-(longest + 2) :])
                for s in stops:
                    if s in tail:
                        req.matched_stop = s
                        return "stop"
        if n_out >= p.max_tokens or req.num_tokens >= context_length:
            return "length"
        return None
