"""Per-request speculation figures as the APIs report them (no torch: the server imports it)."""

from __future__ import annotations

# Per-request counters (Req.counters) and run totals (Scheduler.totals) the speculator keeps.
VERIFY_STEPS, DRAFTED, ACCEPTED = "spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens"


def accept_length(steps: float, accepted: float) -> float | None:
    """Tokens emitted per verify step: the accepted drafts plus the target's own token (K + 1
    when every draft is kept); None before any verify step."""
    return 1 + accepted / steps if steps else None


def spec_report(steps: int, drafted: int, accepted: int) -> dict[str, object]:
    return {
        VERIFY_STEPS: steps,
        DRAFTED: drafted,
        ACCEPTED: accepted,
        "spec_accept_length": accept_length(steps, accepted),
    }
