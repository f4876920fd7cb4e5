"""ZMQ socket helpers: addresses of one server run, PUSH/PULL sockets, message send/receive."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import zmq

from minisgl.ipc.codec import decode, encode

# A closed socket keeps undelivered messages this long (ms): enough to flush a final reply,
# short enough that shutdown never hangs on a peer that is already gone.
LINGER_MS = 500

Socket = zmq.Socket[bytes]
Context = zmq.Context[Socket]


@dataclass(frozen=True)
class IpcAddresses:
    """The inbox (PULL socket, bound by its owner) of each process of one server run."""

    scheduler: str
    worker: str
    frontend: str

    @classmethod
    def in_dir(cls, run_dir: Path) -> IpcAddresses:
        # ipc:// paths are limited to ~107 bytes; a short temp dir keeps us well under.
        return cls(
            scheduler=f"ipc://{run_dir}/scheduler",
            worker=f"ipc://{run_dir}/worker",
            frontend=f"ipc://{run_dir}/frontend",
        )


def _configure(sock: Socket) -> None:
    # No high-water mark: a PUSH at its HWM blocks, and a blocked scheduler would stall
    # every request. Queues stay small because every consumer drains its inbox eagerly.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, LINGER_MS)


def bind_pull(ctx: Context, address: str) -> Socket:
    sock = ctx.socket(zmq.PULL)
    _configure(sock)
    sock.bind(address)
    return sock


def connect_push(ctx: Context, address: str) -> Socket:
    # Connecting before the peer binds is fine: ZMQ queues messages and retries the connect,
    # so nothing sent during startup is lost.
    sock = ctx.socket(zmq.PUSH)
    _configure(sock)
    sock.connect(address)
    return sock


def send(sock: Socket, msg: object) -> None:
    sock.send(encode(msg), copy=False)


def recv_all(sock: Socket, timeout_ms: int | None) -> list[object]:
    """Wait up to ``timeout_ms`` (None: forever, 0: not at all) for a message, then drain
    whatever else is already queued."""
    msgs: list[object] = []
    if timeout_ms != 0 and not sock.poll(timeout_ms):
        return msgs
    while True:
        try:
            data = sock.recv(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return msgs
        msgs.append(decode(data.bytes))
