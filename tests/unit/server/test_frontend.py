"""Host paths of the API server that a burst of long-prompt streaming requests stresses:
output routing while requests arrive, batched SSE writes, and a gone client. (The codec,
prompt checks and in-batch shared-prefix check it also stresses are tested in
tests/unit/ipc/test_codec.py, server/test_protocol.py and scheduler/test_admission.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import zmq

from minisgl.ipc import sockets
from minisgl.ipc.messages import SubmitItem, TextOutput, TextOutputs
from minisgl.server.errors import ClientGone
from minisgl.server.frontend import Frontend
from minisgl.server.request_group import RequestGroup


# ---------------------------------------------------------------- batched outputs
def _out(rid: int, text: str, finish: str | None = None) -> TextOutput:
    return TextOutput(rid, text, [1], completion_tokens=1, finish_reason=finish)


def test_outputs_come_in_batches_of_what_is_queued() -> None:
    async def run() -> list[list[str]]:
        group = RequestGroup(None, [1, 2])  # type: ignore[arg-type]
        for out in (_out(1, "a"), _out(2, "b"), _out(1, "c", "length")):
            group.queue.put_nowait(out)
        batches: list[list[str]] = []

        async def more() -> None:
            await asyncio.sleep(0.01)
            group.queue.put_nowait(_out(2, "d", "length"))
            group.queue.put_nowait(_out(2, "late"))  # after every sequence finished

        task = asyncio.ensure_future(more())
        async for batch in group.batches(_out(2, "first")):
            batches.append([o.text for o in batch])
        await task
        assert group.queue.qsize() == 1  # the output after the end is not consumed
        return batches

    assert asyncio.run(run()) == [["first", "a", "b", "c"], ["d"]]


def test_a_gone_client_wakes_the_waiters() -> None:
    """client_gone (the disconnect watcher) ends a wait for the first output with ClientGone
    and ends a stream of batches after what was already queued."""

    async def run() -> list[list[str]]:
        waiting = RequestGroup(None, [1])  # type: ignore[arg-type]
        first = asyncio.ensure_future(waiting.first())
        await asyncio.sleep(0)
        waiting.client_gone()
        with pytest.raises(ClientGone):
            await first
        streaming = RequestGroup(None, [1])  # type: ignore[arg-type]
        streaming.queue.put_nowait(_out(1, "b"))
        batches: list[list[str]] = []

        async def leave() -> None:
            await asyncio.sleep(0.01)
            streaming.client_gone()
            streaming.client_gone()  # once is enough: no second wake-up queued

        task = asyncio.ensure_future(leave())
        async for batch in streaming.batches(_out(1, "a")):
            batches.append([o.text for o in batch])
        await task
        assert streaming.gone and streaming.queue.empty()
        return batches

    assert asyncio.run(run()) == [["a", "b"]]


# ---------------------------------------------------------------- routing during a burst
def test_outputs_are_routed_while_requests_keep_arriving(tmp_path: Path) -> None:
    """Submitting a request routes what has arrived for others, without the loop getting a
    turn; an idle loop routes through its reader."""
    addresses = sockets.IpcAddresses.in_dir(tmp_path)

    async def run() -> None:
        frontend = Frontend(addresses)
        await frontend.start()
        ctx = zmq.Context()
        worker = sockets.bind_pull(ctx, addresses.worker)
        push = sockets.connect_push(ctx, addresses.frontend)
        try:
            first = frontend.submit([SubmitItem(0, input_ids=[1, 2])])
            assert worker.poll(5000)  # the request went out
            sockets.send(push, TextOutputs([_out(first.rids[0], "x")]))
            # Wait for delivery without giving the event loop a turn (no await).
            assert frontend.inbox.poll(5000)
            assert first.queue.empty()  # nothing ran the reader yet
            frontend.submit([SubmitItem(0, input_ids=[3])])
            assert first.queue.get_nowait().text == "x"
            # Idle: the event loop's reader routes it.
            sockets.send(push, TextOutputs([_out(first.rids[0], "y", "length")]))
            out = await asyncio.wait_for(first.first(), 5)
            assert out.text == "y" and out.finished
        finally:
            push.close(0)
            worker.close(0)
            ctx.term()
            await frontend.stop()

    asyncio.run(run())
