"""What the server's scheduler loop (minisgl/scheduler/process.py) needs to run on TP ranks.

Every rank runs the same `SchedulerLoop`. Rank 0 reads its ZMQ inbox; before applying what
it read, it calls ``sync.exchange(msgs)``, which hands every rank that same list (the other
ranks pass nothing and never read a socket). So each iteration every rank applies the same
messages in the same order and then steps: identical batches, identical tokens. Only rank 0
sends outputs. When rank 0's loop ends it calls ``sync.stop()``; the others then get None
from ``exchange`` and leave theirs.
"""

from __future__ import annotations

from typing import Any

from minisgl.distributed import TPInfo
from minisgl.distributed.channel import EventChannel

MODE = "server"


class RankSync:
    def __init__(self, tp: TPInfo, channel: EventChannel | None = None) -> None:
        self.tp = tp
        self.channel = channel or EventChannel(tp)
        self.stopped = False
        # Fails with a clear message if a node was started for another mode (e.g. offline).
        self.channel.handshake(MODE)

    @property
    def reads_inbox(self) -> bool:
        """Only rank 0 owns sockets: it reads requests and sends outputs."""
        return self.tp.is_primary

    def exchange(self, msgs: list[Any] | None = None) -> list[Any] | None:
        """Rank 0: pass the messages read this iteration (maybe []); every rank gets them
        back in rank 0's order. None means rank 0 has stopped: leave the loop."""
        if self.tp.size == 1:
            return msgs
        if self.tp.is_primary:
            assert msgs is not None, "rank 0 sends a list every iteration, [] when idle"
            return list(self.channel.broadcast(("msgs", msgs))[1])
        kind, payload = self.channel.broadcast()
        if kind == "stop":
            self.stopped = True
            return None
        return list(payload)

    def stop(self) -> None:
        """Rank 0, when its loop ends for any reason: release the other ranks."""
        if self.tp.is_primary and self.tp.size > 1 and not self.stopped:
            self.stopped = True
            self.channel.broadcast(("stop", None))

    def gather(self, obj: Any) -> list[Any] | None:
        """Per-rank answers (e.g. each rank's integrity error or None) on rank 0, rank order.
        Every rank must call it at the same point of the same iteration."""
        return self.channel.gather(obj)
