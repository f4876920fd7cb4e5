"""What the server's scheduler loop (minisgl/server/scheduler_process.py) needs to run on TP ranks.

Every rank runs the same `SchedulerLoop`. Rank 0 reads its ZMQ inbox; before applying what
it read, it calls ``sync.exchange(msgs)``, which hands every rank that same list (the other
ranks pass nothing and never read a socket). So each iteration every rank applies the same
messages in the same order and then steps: identical batches, identical tokens. Only rank 0
sends outputs. When rank 0's loop ends it calls ``sync.stop()``; the others then get None
from ``exchange``, acknowledge, and leave theirs. At startup ``require_same`` makes a rank
started with other engine flags fail, and ``share`` hands every rank rank 0's server flags.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar, cast

from minisgl.distributed import TPInfo
from minisgl.distributed.channel import EventChannel, ProtocolMismatch

MODE = "server"
T = TypeVar("T")


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

    def exchange(self, msgs: list[object] | None = None) -> list[object] | None:
        """Rank 0: pass the messages read this iteration (maybe []); every rank gets them
        back in rank 0's order. None means rank 0 has stopped: leave the loop."""
        if self.tp.size == 1:
            return msgs
        if self.tp.is_primary:
            assert msgs is not None, "rank 0 sends a list every iteration, [] when idle"
            self.channel.broadcast(("msgs", msgs))
            return msgs
        kind, payload = cast("tuple[str, list[object]]", self.channel.broadcast())
        if kind == "stop":
            self.stopped = True
            self.channel.gather(None)  # the acknowledgement `stop` waits for
            return None
        return list(payload)

    def stop(self) -> None:
        """Rank 0, when its loop ends in order: release the other ranks. Returns once every
        rank has received the word: rank 0 exits right after, and a process that exits with
        a message still on its way may take the message down with its connection."""
        if self.tp.is_primary and self.tp.size > 1 and not self.stopped:
            self.stopped = True
            self.channel.broadcast(("stop", None))
            self.channel.gather(None)

    def share(self, value: T) -> T:
        """Startup, every rank: rank 0's ``value`` (e.g. a server flag that only node 0 got)."""
        return cast(T, self.channel.broadcast(value if self.tp.is_primary else None))

    def require_same(self, value: object, what: str) -> None:
        """Startup, every rank: fail unless ``value`` equals rank 0's (e.g. the engine flags:
        ranks that schedule differently diverge at the first step). The rank that differs
        fails, and rank 0 fails too, naming every such rank."""
        first = self.share(value)
        mine = None if first == value else f"rank {self.tp.rank}: {_differences(first, value)}"
        others = [m for m in self.gather(mine) or [] if m is not None]
        if mine is not None or others:
            raise ProtocolMismatch(
                f"{what} differ from rank 0's: {'; '.join(others or [str(mine)])}"
            )

    def gather(self, obj: T) -> list[T] | None:
        """Per-rank answers (e.g. each rank's integrity error or None) on rank 0, rank order.
        Every rank must call it at the same point of the same iteration."""
        return self.channel.gather(obj)


def _differences(first: object, value: object) -> str:
    if dataclasses.is_dataclass(first) and type(first) is type(value):
        names = [f.name for f in dataclasses.fields(first)]
        return ", ".join(
            f"{n}={getattr(value, n)!r} (rank 0: {getattr(first, n)!r})"
            for n in names
            if getattr(value, n) != getattr(first, n)
        )
    return f"{value!r} (rank 0: {first!r})"
