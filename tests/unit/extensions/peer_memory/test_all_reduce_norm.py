"""The fused TP all-reduce + residual add + RMSNorm kernel of the peer-memory extension
(minisgl/extensions/peer_memory/kernels/all_reduce_norm.py), checked as one rank of a
simulated group: the peers' rows are put in this rank's buffer before the call, as the
peers' own calls would have, so the kernel's wait ends at once.

Checked against the unfused path, the rank-ordered sum followed by ``fused_add_rms_norm``
(bit-equal where the device's casts round like torch's; see kernels/test_fused_ops.py on the
interpreter's bfloat16 casts), plus the protocol's state: the partial sum lands in every
peer's buffer, in the slot of the call's parity and this rank; the slots this rank read are
back to the sentinel; nothing past the rows is touched; the epochs advance by one per call.
Two consecutive calls use both parities. A partial that is the sentinel's bit pattern goes
out as the canonical NaN. With ``gemv_k``, this rank's partial sum comes from the batch-1
GEMV that pushes it to the peers itself (the extension's kernels/pushing_gemv.py), and the
kernel only polls (``pushed=True``): the same state must result, and the pushed rows must
be the core GEMV's (kernels/gemv.py) bits. The cross-GPU run (real peers through NVLink,
CUDA graphs) is tests/gpu/test_spec_and_tp_gpu.py's TP=2 tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # the interpreter child: make `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from tests import kernel_checks  # noqa: E402

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
MAX_PROGRAMS = 8
EPS = 1e-6


def _sentinel(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """n elements of ``dtype`` with every byte 0xFF (the kernel's "not yet written")."""
    return torch.full((n * dtype.itemsize,), 0xFF, dtype=torch.uint8, device=device).view(dtype)


def _is_sentinel(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).eq(0xFF).view(-1, t.element_size()).all(dim=1)


def _run_group(
    device: torch.device, dtype: torch.dtype, world: int, rank: int, rows: int, d: int, res: bool,
    sentinel_row: bool = False, gemv_k: int = 0, flat: bool = False,
) -> None:  # fmt: skip
    from minisgl.extensions.peer_memory.kernels.all_reduce_norm import (
        LamportPush,
        all_reduce_add_rms_norm,
        programs,
    )
    from minisgl.extensions.peer_memory.kernels.pushing_gemv import pushing_gemv
    from minisgl.kernels.gemv import gemv
    from minisgl.kernels.norm import fused_add_rms_norm, rms_norm, row_tile

    g = torch.Generator().manual_seed(100 * world + 10 * rank + rows)
    slot = rows * d + 64  # room to spare: nothing may be written past the rows
    bufs = [_sentinel(2 * world * slot, dtype, device) for _ in range(world)]
    epochs = torch.zeros(MAX_PROGRAMS, dtype=torch.int64, device=device)
    buf_ptrs = torch.tensor([b.data_ptr() for b in bufs], device=device)
    weight = torch.randn(d, generator=g).to(dtype).to(device)
    n_prog = programs(rows, d)

    def slot_of(owner: int, parity: int, src: int) -> torch.Tensor:
        start = (parity * world + src) * slot
        return bufs[owner][start : start + slot]

    for epoch in (1, 2):
        parts = [torch.randn(rows, d, generator=g).to(dtype).to(device) for _ in range(world)]
        if gemv_k:  # this rank's partial: a GEMV's output (the plain GEMV's bits)
            x_in = torch.randn(rows, gemv_k, generator=g).to(dtype).to(device)
            w_in = (torch.randn(d, gemv_k, generator=g) / gemv_k**0.5).to(dtype).to(device)
            # Wide column blocks: few programs, for the interpreter's sake. ``flat``: the
            # one-row products in the weights' 2-D layout (the engine's small weights).
            tiles = (1 << (rows - 1).bit_length(), 128, 64, 4, 1, int(flat))
            parts[rank] = gemv(x_in, w_in, tiles=tiles)
        if sentinel_row:  # a partial element with the sentinel's bits (a NaN)
            parts[rank].view(-1)[:1] = _sentinel(1, dtype, device)
        residual = torch.randn(rows, d, generator=g).to(dtype).to(device) if res else None
        s = epoch % 2
        for q in range(world):  # the peers' side of this call: their rows, pushed to us
            if q != rank:
                slot_of(rank, s, q)[: rows * d] = parts[q].reshape(-1)
        x = parts[rank]
        if gemv_k:
            lamport = LamportPush(bufs[rank], buf_ptrs, epochs, slot, rank, row_tile(d)[0])
            x = pushing_gemv(x_in, w_in, tiles, lamport)
            assert torch.equal(x, parts[rank]), "the pushing GEMV's rows are the GEMV's"
            assert epochs[:n_prog].eq(epoch - 1).all(), "the GEMV only reads the epochs"
        out, res_out = all_reduce_add_rms_norm(
            x, residual, weight, EPS, bufs[rank], buf_ptrs, epochs, slot, rank, pushed=gemv_k > 0
        )
        total = parts[0]
        for q in range(1, world):
            total = total + parts[q]
        if residual is not None:
            want, want_res = fused_add_rms_norm(total, residual, weight, EPS)
        else:
            want, want_res = rms_norm(total, weight, EPS), total
        if sentinel_row:
            assert torch.isnan(res_out.view(-1)[0])  # any NaN: only what is sent matters
            want, want_res, out, res_out = (t.view(-1)[d:] for t in (want, want_res, out, res_out))
        if dtype != BF16 or device.type == "cuda":
            assert torch.equal(res_out, want_res) and torch.equal(out, want), (epoch, rank)
        else:  # the interpreter truncates float32 -> bfloat16 (rounded sums differ by ulps)
            torch.testing.assert_close(res_out.float(), want_res.float(), atol=4e-2, rtol=4e-2)
            torch.testing.assert_close(out.float(), want.float(), atol=6e-2, rtol=6e-2)
        for q in range(world):
            if q == rank:
                continue
            pushed = slot_of(q, s, rank)
            sent = pushed[: rows * d].view(rows, d)
            if sentinel_row:
                assert torch.isnan(sent.view(-1)[0]) and not _is_sentinel(sent.view(-1)[:1])
                assert torch.equal(sent.view(-1)[1:], parts[rank].view(-1)[1:])
            else:
                assert torch.equal(sent, parts[rank]), "the partial sum is in the peer's slot"
            assert _is_sentinel(pushed[rows * d :]).all(), "nothing past the rows"
            assert _is_sentinel(slot_of(rank, s, q)).all(), "read slots are reset"
            assert _is_sentinel(slot_of(q, 1 - s, rank)).all(), "the other parity untouched"
        assert _is_sentinel(slot_of(rank, s, rank)).all(), "no slot of its own is written"
        assert epochs[:n_prog].eq(epoch).all() and epochs[n_prog:].eq(0).all()
        for q in range(world):  # the peers consume what this rank pushed (their reset)
            if q != rank:
                slot_of(q, s, rank).copy_(_sentinel(slot, dtype, device))


def check_two_ranks_matches_unfused(device: torch.device) -> None:
    for dtype in (F32, F16, BF16):
        for rank in (0, 1):
            _run_group(device, dtype, 2, rank, rows=5, d=96, res=True)


def check_several_programs_and_wide_rows(device: torch.device) -> None:
    # d = 4096: one row per program, so three programs with their own flags and epochs.
    _run_group(device, F32, 2, 1, rows=3, d=4096, res=True)
    _run_group(device, F16, 2, 0, rows=3, d=1000, res=True)


def check_without_residual(device: torch.device) -> None:
    # The first layer's input norm: the embedding's partial sums, no residual yet.
    _run_group(device, F32, 2, 0, rows=4, d=128, res=False)


def check_four_ranks_sum_in_rank_order(device: torch.device) -> None:
    for rank in (0, 2, 3):
        _run_group(device, F16, 4, rank, rows=2, d=256, res=True)


def check_sentinel_bits_go_as_nan(device: torch.device) -> None:
    for dtype in (F32, BF16):
        _run_group(device, dtype, 2, 0, rows=2, d=64, res=True, sentinel_row=True)


def check_gemv_pushes_the_rows(device: torch.device) -> None:
    # Batch 1 (the engine's case), and 3 rows over 3 programs (d = 2048: a row each) or
    # one program (d = 96), each row at the epoch of its own program.
    for dtype in (F32, BF16):
        for rank in (0, 1):
            _run_group(device, dtype, 2, rank, rows=1, d=96, res=True, gemv_k=64)
        # FLAT tiles, over several K steps (the last one masked).
        _run_group(device, dtype, 2, 1, rows=1, d=96, res=True, gemv_k=160, flat=True)
    _run_group(device, F16, 2, 1, rows=3, d=2048, res=True, gemv_k=32)
    _run_group(device, F16, 2, 0, rows=3, d=96, res=False, gemv_k=48)
    _run_group(device, F16, 4, 2, rows=2, d=256, res=True, gemv_k=32)


CHECKS = kernel_checks.collect(globals())


test_interpreted, test_on_gpu = kernel_checks.make_tests(__file__, CHECKS)


if __name__ == "__main__":
    kernel_checks.main(CHECKS)
