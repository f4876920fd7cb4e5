"""Host paths of the API server that a burst of long-prompt streaming requests stresses:
IPC codec, prompt checks, output routing while requests arrive, batched SSE writes, and the
scheduler's in-batch shared-prefix check."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from minisgl.ipc import sockets
from minisgl.ipc.codec import decode, encode, message
from minisgl.ipc.messages import (
    SubmitItem,
    TextOutput,
    TextOutputs,
    TokenLogprob,
    TokenOutput,
)
from minisgl.scheduler.admission import IN_BATCH_PREFIX_MIN, _shares_prefix
from minisgl.server.errors import ClientGone
from minisgl.server.frontend import Frontend
from minisgl.server.protocol import MAX_TOKEN_ID, CompletionRequest
from minisgl.server.request_group import RequestGroup


# ---------------------------------------------------------------- codec
@message
@dataclasses.dataclass
class _Probe:
    a: int
    b: int = 0
    c: list[int] = dataclasses.field(default_factory=list)
    d: str | None = None


def test_trailing_defaults_are_left_out_and_restored() -> None:
    full = encode(_Probe(1, 2, [3], "x"))
    short = encode(_Probe(1))
    assert len(short) < len(full)
    assert decode(short) == _Probe(1)
    assert decode(encode(_Probe(1, d="x"))) == _Probe(1, 0, [], "x")  # inner defaults kept
    # A value equal to its default but of another type is sent as it is.
    out = decode(encode(_Probe(1, False)))
    assert out.b is False
    # Each decoded message gets its own default list.
    x, y = decode(encode([_Probe(1), _Probe(2)]))
    assert x.c is not y.c


def test_decode_output_of_one_step() -> None:
    outs = [
        TextOutput(i, " t5", [5], 2100, 3, 2000, finish_reason="length" if i == 3 else None)
        for i in range(4)
    ]
    outs.append(TextOutput(9, "", [], logprobs=[TokenLogprob(5, -0.5)], error="boom"))
    msg = decode(encode(TextOutputs(outs)))
    assert msg == TextOutputs(outs)
    assert [o.finished for o in msg.outputs] == [False, False, False, True, False]


def test_plain_lists_and_foreign_extensions_pass_through() -> None:
    data = [[1, 2], [], [[3]], {"k": [4]}]
    assert decode(encode(data)) == data
    ext = msgpack.ExtType(7, b"raw")
    assert decode(msgpack.packb([ext])) == [ext]


# ---------------------------------------------------------------- prompt checks
def test_token_id_prompts_are_checked_without_changing_meaning() -> None:
    ids = list(range(2100))
    assert CompletionRequest(prompt=ids).prompts() == [ids]
    assert CompletionRequest(prompt=[[1, 2], [3]]).prompts() == [[1, 2], [3]]
    assert CompletionRequest(prompt=[0, MAX_TOKEN_ID]).prompts() == [[0, MAX_TOKEN_ID]]
    bad = [[1, True], [1, -1], [1, MAX_TOKEN_ID + 1], [1, 2.0], [1, "2"], [[1], [True]], [[1], []]]
    for prompt in bad:
        with pytest.raises(ValueError, match="prompt must be"):
            CompletionRequest(prompt=prompt).prompts()


# ---------------------------------------------------------------- scheduler
def _common_prefix(a: list[int], b: list[int]) -> int:  # the definition the check replaced
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


@given(
    st.lists(st.integers(0, 2), min_size=0, max_size=80),
    st.lists(st.integers(0, 2), min_size=0, max_size=80),
    st.integers(0, 48),
)
def test_shared_prefix_check_matches_the_common_prefix(a: list[int], b: list[int], cached: int):
    # Small alphabets so that long common prefixes occur.
    expected = _common_prefix(a, b) - cached >= IN_BATCH_PREFIX_MIN
    assert _shares_prefix(a, b, cached + IN_BATCH_PREFIX_MIN) == expected


def test_shared_prefix_check_on_long_prompts() -> None:
    rng = random.Random(0)
    system = [rng.randrange(3, 4096) for _ in range(2000)]
    a = system + [rng.randrange(3, 4096) for _ in range(100)]
    b = system + [rng.randrange(3, 4096) for _ in range(100)]
    assert _shares_prefix(a, b, IN_BATCH_PREFIX_MIN)  # nothing cached yet: defer b
    assert not _shares_prefix(a, b, 2000 + IN_BATCH_PREFIX_MIN)  # system prompt cached
    c = list(a)
    c[5] += 1  # differs inside the cached part, agrees after it
    assert not _shares_prefix(a, c, 1000 + IN_BATCH_PREFIX_MIN)


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


def test_token_output_defaults_round_trip() -> None:
    out = TokenOutput(3, [7], 2100, 1, 2000)
    assert decode(encode(out)) == out
