"""Inter-process messaging: message dataclasses (msgpack-encoded) over ZMQ PUSH/PULL sockets."""

from __future__ import annotations
