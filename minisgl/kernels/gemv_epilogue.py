"""Epilogues of the batch-1 GEMV (kernels/gemv.py): the grid's last program to finish adds
the residual and applies RMSNorm to the whole rows (and, with TP, first sums them with the
peers' over GPU peer memory), so the norm kernel (or the all-reduce + norm kernel) that would
follow is never launched. Same tiles and arithmetic as kernels/norm.py and
kernels/all_reduce_norm.py: bit-equal results."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minisgl.kernels.all_reduce_norm import exchange, publish, sum_add_norm


@triton.jit
def add_rms_norm_epilogue(
    y_ptr, res_ptr, nw_ptr, norm_out_ptr, res_out_ptr, counter_ptr, rows, n_cols, stride_ym,
    eps, NORM_M: tl.constexpr, NORM_N: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    # Every program has stored its columns of y; the last one to finish adds the residual
    # and normalises whole rows, with the arithmetic and tile of kernels/norm.py (the same
    # bits), so the norm kernel that would follow is not launched. The barrier and the
    # acquire-release count order every program's stores before the last one's loads.
    tl.debug_barrier()
    finished = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if finished == tl.num_programs(0) - 1:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next call
        cols = tl.arange(0, NORM_N)
        col_mask = cols < n_cols
        for r0 in range(0, rows, NORM_M):
            rr = r0 + tl.arange(0, NORM_M)
            mask = (rr < rows)[:, None] & col_mask[None, :]
            y_off = (rr * stride_ym)[:, None] + cols[None, :]
            x = tl.load(y_ptr + y_off, mask=mask, other=0.0, volatile=True)  # not from L1
            # A "sum" over one rank (no buffers read), then the residual and the norm.
            sum_add_norm(
                x, y_ptr, 0, res_ptr, n_cols, nw_ptr, norm_out_ptr, res_out_ptr, rr, cols,
                col_mask, mask, n_cols, 0, eps, 0, 1, True, ASM,
            )  # fmt: skip


@triton.jit
def all_reduce_add_rms_norm_epilogue(
    y_ptr, res_ptr, nw_ptr, norm_out_ptr, res_out_ptr, counter_ptr, rows, n_cols, stride_ym,
    eps, bufs_ptr, flags_ptr, epochs_ptr, slot_elems,
    NORM_M: tl.constexpr, NORM_N: tl.constexpr, ASM: tl.constexpr, RANK: tl.constexpr,
    WORLD: tl.constexpr, MAX_PROGRAMS: tl.constexpr,
):  # fmt: skip
    # TP > 1: the last program to finish all-reduces the rows with the peers and adds and
    # normalises them: kernels/all_reduce_norm.py's steps as its program 0 would take them
    # (one epoch and flag for the call; the same rows, slots and arithmetic).
    tl.debug_barrier()
    finished = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if finished == tl.num_programs(0) - 1:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next call
        epoch = tl.load(epochs_ptr) + 1
        tl.store(epochs_ptr, epoch)
        cols = tl.arange(0, NORM_N)
        col_mask = cols < n_cols
        for r0 in range(0, rows, NORM_M):
            rr = r0 + tl.arange(0, NORM_M)
            mask = (rr < rows)[:, None] & col_mask[None, :]
            publish(y_ptr, stride_ym, bufs_ptr, epoch, rr, cols, mask, n_cols, slot_elems, RANK,
                    True)  # fmt: skip
        exchange(flags_ptr, 0, epoch, RANK, WORLD, MAX_PROGRAMS)
        for r0 in range(0, rows, NORM_M):
            rr = r0 + tl.arange(0, NORM_M)
            mask = (rr < rows)[:, None] & col_mask[None, :]
            x = tl.load(y_ptr + (rr * stride_ym)[:, None] + cols[None, :], mask=mask, other=0.0,
                        volatile=True)  # fmt: skip
            sum_add_norm(
                x, bufs_ptr, epoch, res_ptr, n_cols, nw_ptr, norm_out_ptr, res_out_ptr, rr,
                cols, col_mask, mask, n_cols, slot_elems, eps, RANK, WORLD, True, ASM,
            )  # fmt: skip


@dataclass(frozen=True)
class PeerSum:
    """Where TP ranks sum their partial products (distributed/peer_all_reduce.py's
    buffers, as kernels/all_reduce_norm.py takes them)."""

    bufs: torch.Tensor
    flags: torch.Tensor
    epochs: torch.Tensor
    slot_elems: int
    rank: int


_counters: dict[torch.device, torch.Tensor] = {}


def finished_counter(device: torch.device) -> torch.Tensor:
    """The finished-program count the norm epilogue uses (the last program resets it; the
    calls on a device run one after another on its stream). Allocated by the first, eager
    call: CUDA graphs capture the warm-up run's launches, never the first."""
    if device not in _counters:
        _counters[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _counters[device]
