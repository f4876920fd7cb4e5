"""Rank 0 -> all ranks: an ordered stream of picklable objects over the gloo control group.

Every rank must apply the same scheduler events in the same order before each step, or the
ranks build different batches and their collectives hang or mix garbage. The channel makes
that structural: rank 0 decides what happens next and ``broadcast`` hands every rank the
very same object (the same list, in the same order); followers never read an inbox of their
own. ``gather`` brings per-rank answers (integrity checks, shard sizes) back to rank 0.
"""

from __future__ import annotations

from typing import TypeVar

import torch.distributed as dist

from minisgl.distributed import TPInfo
from minisgl.distributed.group import control_group

PROTOCOL = 1  # bump when the meaning of the stream changes
T = TypeVar("T")


class ProtocolMismatch(RuntimeError):
    pass


class EventChannel:
    def __init__(self, tp: TPInfo, group: dist.ProcessGroup | None = None) -> None:
        self.tp = tp
        self.group = group if group is not None or tp.size == 1 else control_group()

    def broadcast(self, obj: object = None) -> object:
        """Rank 0 passes ``obj``; every rank (rank 0 included) gets rank 0's ``obj`` back.
        Followers block until rank 0 sends, for as long as that takes."""
        if self.tp.size == 1:
            return obj
        box = [obj if self.tp.is_primary else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: T) -> list[T] | None:
        """Every rank's ``obj`` (the same kind on every rank), in rank order, on rank 0; None
        elsewhere."""
        if self.tp.size == 1:
            return [obj]
        # Placeholders, each replaced by that rank's object.
        out = [obj] * self.tp.size if self.tp.is_primary else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def handshake(self, mode: str) -> None:
        """Agree on what the stream carries (e.g. "offline" LLM calls or "server" messages):
        a node started for the wrong mode fails here with a clear message on rank 0."""
        sent = self.broadcast((PROTOCOL, mode) if self.tp.is_primary else None)
        ok = sent == (PROTOCOL, mode)
        answers = self.gather(None if ok else f"rank {self.tp.rank} runs {mode!r}, got {sent!r}")
        if not ok:
            raise ProtocolMismatch(f"rank 0 sent {sent!r}, this rank runs {(PROTOCOL, mode)!r}")
        errors = [a for a in answers or [] if a is not None]
        if errors:
            raise ProtocolMismatch("; ".join(errors))
