"""Per-request speculation figures as the APIs report them (no torch: the server imports it)."""

from __future__ import annotations

from typing import Any

# Per-request counters (Req.counters) the speculator keeps.
VERIFY_STEPS, DRAFTED, ACCEPTED = "spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens"


def spec_report(verify_steps: int, draft_tokens: int, accepted_tokens: int) -> dict[str, Any]:
    """``spec_accept_length``: tokens emitted per verify step, i.e. the accepted drafts plus
    the target's own token (K + 1 when every draft is kept); None before any verify step."""
    return {
        "spec_verify_steps": verify_steps,
        "spec_draft_tokens": draft_tokens,
        "spec_accepted_tokens": accepted_tokens,
        "spec_accept_length": 1 + accepted_tokens / verify_steps if verify_steps else None,
    }
