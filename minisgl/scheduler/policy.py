"""Request priorities (``--schedule-policy priority``), vLLM's convention: an integer per
request, lower values served first, default 0, ties by arrival.

The waiting queue is kept in (priority, arrival) order, so admission takes it front to back;
the running request with the largest (priority, arrival) is the one retracted first. With
another policy only priority 0 is accepted, as in vLLM ("priority scheduling is not enabled"):
a request that asks for a priority the server would ignore is told so, not silently demoted.
"""

from __future__ import annotations

from typing import Any

# Priorities cross IPC as msgpack integers: signed 64-bit.
PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1


def check_priority(value: Any, policy: str) -> int:
    """The request's priority, or ValueError naming ``priority``."""
    # bool is an int subclass, but True as a priority is surely a mistake.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"priority must be an integer, got {value!r}")
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise ValueError(f"priority must be in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {value}")
    if value != 0 and policy != "priority":
        raise ValueError(
            f"priority must be 0 unless priority scheduling is enabled "
            f"(--schedule-policy priority; this server uses {policy}), got {value}"
        )
    return value
