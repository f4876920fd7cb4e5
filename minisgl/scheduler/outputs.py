"""What the scheduler process sends for a request: its new tokens since the last report (with
logprobs when asked for), or an error that ends it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minisgl.ipc.messages import TokenLogprob, TokenOutput, TopLogprob

if TYPE_CHECKING:
    from minisgl.scheduler.request import Req


def token_output(req: Req, start: int) -> TokenOutput:
    """``req``'s output tokens from index ``start`` on; the prompt's logprobs come with the
    first report (``start == 0``)."""
    out = TokenOutput(
        rid=req.uid,
        new_ids=req.output_ids[start:],
        prompt_tokens=len(req.prompt_ids),
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens,
        finish_reason=req.finish_reason if req.finished else None,
        matched_stop=req.matched_stop if req.finished else None,
        queue_time=req.queue_time,
        counters=request_counters(req),
    )
    if start == 0 and req.params.prompt_logprobs is not None:
        out.prompt_logprobs = [
            TokenLogprob(
                token_id=req.prompt_ids[i + 1],
                logprob=float(lp),
                top=[TopLogprob(int(t), float(v)) for t, v in req.prompt_top_logprobs[i]]
                if i < len(req.prompt_top_logprobs)
                else [],
            )
            for i, lp in enumerate(req.prompt_logprobs)
        ]
    if req.params.wants_logprobs:
        lps = req.output_logprobs[start:] if req.params.logprobs else []
        tops = req.output_top_logprobs[start:]
        out.logprobs = [
            TokenLogprob(
                token_id=tok,
                logprob=lps[i] if i < len(lps) else 0.0,
                top=[TopLogprob(int(t), float(lp)) for t, lp in tops[i]] if i < len(tops) else [],
            )
            for i, tok in enumerate(out.new_ids)
        ]
    return out


def request_counters(req: Req) -> dict[str, int]:
    """The request's extension counters (running totals), those not zero."""
    return {name: n for name, n in req.counters.items() if n}


def error_output(rid: int, message: str, status: int) -> TokenOutput:
    return TokenOutput(
        rid=rid, new_ids=[], finish_reason="abort", error=message, error_status=status
    )
