"""A stand-in for the tokenizer worker, so that a test can drive a scheduler loop over its
real ZMQ sockets: push requests and control messages, collect what comes back."""

from __future__ import annotations

import time
from typing import Any

import zmq

from minisgl.ipc import sockets
from minisgl.ipc.messages import (
    AddRequests,
    ControlReply,
    ControlRequest,
    StepOutputs,
    TokenizedRequest,
    TokenOutput,
)
from minisgl.sampling_params import SamplingParams
from minisgl.server.scheduler_process import SchedulerLoop


class Harness:
    """Plays the tokenizer worker: pushes to the scheduler's inbox, reads what it sends back."""

    def __init__(self, loop: SchedulerLoop, addresses: sockets.IpcAddresses) -> None:
        self.loop = loop
        self.ctx = zmq.Context()
        self.inbox = sockets.bind_pull(self.ctx, addresses.worker)
        self.to_scheduler = sockets.connect_push(self.ctx, addresses.scheduler)
        self.outputs: dict[int, list[TokenOutput]] = {}
        self.replies: list[ControlReply] = []

    def add(self, *reqs: tuple[int, list[int], dict[str, Any]]) -> None:
        msg = AddRequests([TokenizedRequest(rid, ids, SamplingParams(**p)) for rid, ids, p in reqs])
        sockets.send(self.to_scheduler, msg)

    def pump(self, until: Any, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, "timed out waiting for the scheduler"
            for msg in sockets.recv_all(self.inbox, 100):
                if isinstance(msg, StepOutputs):
                    for out in msg.outputs:
                        self.outputs.setdefault(out.rid, []).append(out)
                elif isinstance(msg, ControlReply):
                    self.replies.append(msg)

    def finished(self, rid: int) -> bool:
        return any(o.finish_reason is not None for o in self.outputs.get(rid, []))

    def control(self, kind: str) -> ControlReply:
        cid = len(self.replies) + 1000
        sockets.send(self.to_scheduler, ControlRequest(cid, kind))
        self.pump(lambda: any(r.cid == cid for r in self.replies))
        return next(r for r in self.replies if r.cid == cid)
