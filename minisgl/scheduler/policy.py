"""Scheduling policies (``--schedule-policy``): in which order waiting requests are admitted,
which running request is retracted first, and what a request's ``priority`` may be.

- ``fcfs``: arrival order; retracted requests go back to the front of the queue (they were
  admitted before anything still waiting); the latest admitted is retracted first.
- ``lpm``: like fcfs, but each step admits the requests with the longest cached prefix first
  (stable: ties stay first-come first-served), while the queue is short enough to sort.
- ``priority``: vLLM's convention, an integer per request, lower values first, ties by
  arrival. The queue is kept in (priority, arrival) order, so admission takes it front to
  back; the running request with the largest (priority, arrival) is retracted first. With
  another policy only priority 0 is accepted, as in vLLM ("priority scheduling is not
  enabled"): a request that asks for a priority the server would ignore is told so.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable

from minisgl.scheduler.request import Req

# Priorities cross IPC as msgpack integers: signed 64-bit.
PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1
LPM_MAX_QUEUE = 128  # beyond this many waiting requests, LPM sorting costs more than it saves


def check_priority(value: object, policy: str) -> int:
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


def priority_key(req: Req) -> tuple[int, int]:
    return (req.priority, req.arrival)


def admit_key(req: Req) -> tuple[int, int]:
    return (0, req.admit_order)


class Policy:
    def __init__(self, name: str) -> None:
        self.name = name
        self.by_priority = name == "priority"
        # Running requests are served (their prefill chunks) in this order and retracted
        # from the last: by priority, else by admission.
        self.rank_key: Callable[[Req], tuple[int, int]] = (
            priority_key if self.by_priority else admit_key
        )

    def enqueue(self, waiting: deque[Req], req: Req, retracted: bool) -> None:
        """Queue a new or retracted request (by priority: at its place, found by bisection,
        so that no step sorts the queue)."""
        if self.by_priority:
            bisect.insort(waiting, req, key=priority_key)
        elif retracted:
            waiting.appendleft(req)
        else:
            waiting.append(req)

    def admission_order(self, waiting: deque[Req], cached: Callable[[Req], int]) -> list[Req]:
        """The waiting requests in the order admission tries them; ``cached(req)`` is the
        length of the request's cached prefix (LPM only)."""
        reqs = list(waiting)
        if self.name == "lpm" and len(reqs) <= LPM_MAX_QUEUE:
            hits = {id(r): cached(r) for r in reqs}
            reqs.sort(key=lambda r: -hits[id(r)])
        return reqs
