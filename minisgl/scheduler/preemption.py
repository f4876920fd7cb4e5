"""Preemption: a running request gives its pages back and waits again.

Two reasons. Pages ran out (admission guessed too much room: the decode of every running
request must fit, so the policy's last request is retracted, and admission guesses
conservatively again). Or, under ``--schedule-policy priority``, the head of the queue could
not be admitted: running requests of strictly lower priority are retracted for it. A
retracted request keeps its computed prefix in the prefix cache and recomputes the rest
when it is admitted again.
"""

from __future__ import annotations

import logging
from collections import deque

from minisgl.scheduler.admission import Admission
from minisgl.scheduler.kv_manager import KVManager
from minisgl.scheduler.policy import Policy
from minisgl.scheduler.request import Req, ReqState

logger = logging.getLogger(__name__)


class Preemption:
    def __init__(
        self,
        kv: KVManager,
        policy: Policy,
        waiting: deque[Req],
        running: list[Req],
        admission: Admission,
    ) -> None:
        self.kv, self.policy, self.waiting, self.running = kv, policy, waiting, running
        self.admission = admission
        self.num_retractions = 0
        self.num_priority_preemptions = 0  # retractions to admit a higher-priority request

    def victim(self, reqs: list[Req]) -> int:
        """The index of the request the policy retracts first."""
        return max(range(len(reqs)), key=lambda i: self.policy.rank_key(reqs[i]))

    def retract(self, req: Req, overcommitted: bool = True) -> None:
        """Free the request's pages (its computed prefix stays in the cache) and requeue it.
        ``overcommitted``: pages ran out, so admission starts guessing conservatively again
        (not so when preempting for priority)."""
        self.num_retractions += 1
        if req in self.running:
            self.running.remove(req)
        self.kv.release(req)
        req.state = ReqState.WAITING
        self.policy.enqueue(self.waiting, req, retracted=True)
        if overcommitted:
            self.admission.reset()
        logger.debug("retracted request %s with %d output tokens", req.uid, len(req.output_ids))

    def for_priority(self) -> None:
        """Last step's admission stopped at a request for want of a row or pages: retract
        running requests of strictly lower priority (larger values) for the queue's head, at
        least one and then until its admission test would pass. (SGLang preempts for waiting
        requests like this; vLLM's priority preemption only covers running requests that run
        out of pages, which the decode rows' allocation does here too.) Equal priorities
        never preempt each other, so requests cannot take turns evicting one another; the
        victims queue behind the head and keep their computed prefix in the cache."""
        head = next((r for r in self.waiting if not r.inflight), None)
        if head is None:
            return
        retracted = False
        while self.running:
            victim = self.running[self.victim(self.running)]
            if victim.priority <= head.priority or (retracted and self.admission.admissible(head)):
                return
            self.retract(victim, overcommitted=False)
            self.num_priority_preemptions += 1
            retracted = True
