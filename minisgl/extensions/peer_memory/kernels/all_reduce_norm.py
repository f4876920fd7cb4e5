"""Tensor-parallel all-reduce fused with the residual add and RMSNorm that follow it.

In a TP decoder every o_proj and down_proj output is all-reduced and then goes straight into
``norm(x + residual)``. At batch 1 both are tiny, latency-bound kernels (Qwen3-8B at TP=2:
73 of each per token), so this does the two in one kernel over GPU peer memory (NVLink),
with no flags and no fences (a "Lamport" exchange: the data is its own flag):

1. each program writes its rows of this rank's partial sum straight into every peer's
   symmetric buffer, in the slot of this call's parity and this rank (remote stores);
2. it reads the peers' rows from its own buffer (local memory), re-reading until no element
   holds the SENTINEL bit pattern (all ones: a NaN no arithmetic produces; a partial sum that
   is this NaN is sent as the canonical NaN), then writes the sentinel back for the slot's
   next use;
3. it sums the ranks' rows in rank order, so every rank gets the same bits, and then adds
   the residual and normalises exactly as kernels/norm.py does (same tile shape, no FMA
   contraction): results equal the unfused all-reduce followed by ``fused_add_rms_norm`` for
   two ranks (a + b rounds once either way).

The critical path is one NVLink write, against a flag exchange plus a remote read before.
Pushes and polls are 16-byte vector accesses (the buffers are 16-byte aligned); the poll
checks every element, so a vector seen in parts only means one more poll, and an aligned
element is never seen half-written. The stores are plain and the polls volatile (system
scope, past L1), as other Lamport all-reduces do.

Slots alternate by call parity: program p keeps a call counter (epoch) in ordinary memory,
and every rank makes the same calls with the same grids, so parities agree across ranks
without host state (CUDA graphs replay it unchanged). A rank writes a peer's slot s at call
e + 2 only after it has read that peer's rows of call e + 1, which the peer wrote after its
call e had read slot s and reset it (stream order), so nothing unread is overwritten and
every reset lands before the next write.

The push may also come earlier, from the batch-1 GEMV that computes the partial sum
(pushing_gemv.py, given a ``LamportPush``): each GEMV program stores its own output columns
into the peers' slots as soon as they are summed, so the rows travel while the GEMV's other
programs still run, and this kernel (``pushed=True``) only reads its own rows and polls.
The GEMV reads the epoch the call will use (the counter + 1) after its PDL wait, when the
previous call of the same program has stored it; the ordering argument above is unchanged,
since the GEMV comes after the previous all-reduce in stream order, as this kernel does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minisgl.kernels import cdiv
from minisgl.kernels.norm import row_tile
from minisgl.kernels.pdl import pdl_args, pdl_wait


@triton.jit(do_not_specialize=["n_rows"])
def _all_reduce_add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, own_ptr, bufs_ptr, epochs_ptr,
    n_rows, n_cols, stride_x, stride_r, slot_elems, eps,
    RANK: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr, ELEM_BYTES: tl.constexpr,
    HAS_RES: tl.constexpr, PUSHED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    dtype = x_ptr.dtype.element_ty
    bits_ty = tl.int16 if ELEM_BYTES == 2 else tl.int32
    # Before the PDL wait, only what no kernel writes (kernels/pdl.py): every rank's buffer
    # address and the norm weight, so that no load of theirs sits on the chain after it.
    ranks = tl.arange(0, WORLD_P2)
    buf_addrs = tl.load(bufs_ptr + ranks, mask=ranks < WORLD, other=0)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    pdl_wait(PDL)

    epoch = tl.load(epochs_ptr + pid) + 1
    tl.store(epochs_ptr + pid, epoch)
    row_off = (rows * n_cols)[:, None] + cols[None, :]
    parity_off = (epoch % 2) * WORLD * slot_elems
    x = tl.load(x_ptr + (rows * stride_x)[:, None] + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:  # requested now, so that it arrives while the peers' rows travel
        r = tl.load(res_ptr + (rows * stride_r)[:, None] + cols[None, :], mask=mask, other=0.0)
    x = sendable(x, ELEM_BYTES)
    if not PUSHED:  # else the GEMV that computed x has pushed it already
        dst = parity_off + RANK * slot_elems + row_off
        push(own_ptr, buf_addrs, ranks, x, dst, mask, RANK, WORLD, ELEM_BYTES)

    # Sum in rank order, rounding after each add like a chain of dtype additions.
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for q in tl.static_range(WORLD):
        if q == RANK:
            part = x.to(tl.float32)
        else:
            src = own_ptr + parity_off + q * slot_elems + row_off
            got = tl.load(src, mask=mask, other=0.0, volatile=True)
            while tl.sum((mask & (got.to(bits_ty, bitcast=True) == -1)).to(tl.int32)) > 0:
                got = tl.load(src, mask=mask, other=0.0, volatile=True)
            # Ready for the slot's next use (call epoch + 2): the sentinel again. The store's
            # layout may give an element to another thread than the one that polled it, so
            # every thread's last poll is done first (the loop's reduction also orders them;
            # this keeps it so if the loop ever exits per thread).
            tl.debug_barrier()
            tl.store(src.to(tl.pointer_type(bits_ty)), tl.full(got.shape, -1, bits_ty), mask=mask)
            part = got.to(tl.float32)
        if q == 0:
            acc = part
        else:
            acc = (acc + part).to(dtype).to(tl.float32)
    if HAS_RES:
        acc = (acc + r.to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(res_out_ptr + row_off, acc.to(dtype), mask=mask)

    var = tl.sum(acc * acc, axis=1) / n_cols
    rstd = tl.rsqrt(var + eps)
    y = (acc * rstd[:, None]).to(dtype).to(tl.float32)
    tl.store(out_ptr + row_off, (y * w[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def sendable(x, ELEM_BYTES: tl.constexpr):
    """x, with the one partial that could pass for "not yet written" (all ones, a NaN) as
    another NaN (all ones but the last bit): it goes so to the peers and into this rank's own
    sum alike, so every rank sums the same bits. (On the bits: Triton 3.6's interpreter has
    no bf16 NaN constant.)"""
    bits_ty = tl.int16 if ELEM_BYTES == 2 else tl.int32
    xb = x.to(bits_ty, bitcast=True)
    return tl.where(xb == -1, xb - 1, xb).to(x.dtype, bitcast=True)


@triton.jit
def push(
    own_ptr, buf_addrs, ranks, x, dst, mask,
    RANK: tl.constexpr, WORLD: tl.constexpr, ELEM_BYTES: tl.constexpr,
):  # fmt: skip
    """Stores x at element offsets ``dst`` of every peer's buffer (remote stores); buf_addrs:
    every rank's buffer address (``ranks`` their indices), own_ptr this rank's."""
    own_addr = _pick(buf_addrs, ranks, RANK)  # registers only
    for q in tl.static_range(WORLD):
        if q != RANK:
            # Rank q's buffer as an offset from this rank's, in elements: a multiple of 16
            # (buffers are 16-byte aligned at least), which lets the stores vectorise.
            peer = tl.multiple_of((_pick(buf_addrs, ranks, q) - own_addr) // ELEM_BYTES, 16)
            tl.store(own_ptr + peer + dst, x, mask=mask)


@triton.jit
def _pick(values, index, i: tl.constexpr):
    """values[i] of a small vector already in registers (no memory access)."""
    return tl.sum(tl.where(index == i, values, 0), axis=0)


def programs(n_rows: int, n_cols: int) -> int:
    """Programs (one epoch each) that a call on [n_rows, n_cols] launches."""
    return cdiv(n_rows, row_tile(n_cols)[0])


@dataclass(frozen=True)
class LamportPush:
    """Where a GEMV pushes its output rows for the all-reduce that follows it (see above):
    the buffers, epochs and slot size of `all_reduce_add_rms_norm`, and ``block_m``, the rows
    per program of that call (row r's epoch is ``epochs[r // block_m]``)."""

    own: torch.Tensor  # this rank's buffer, viewed in the pushed dtype
    bufs: torch.Tensor
    epochs: torch.Tensor
    slot_elems: int
    rank: int
    block_m: int


def all_reduce_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    own: torch.Tensor,
    bufs: torch.Tensor,
    epochs: torch.Tensor,
    slot_elems: int,
    rank: int,
    pushed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(sum + residual) * weight, sum + residual), sum = x summed over the ranks.

    x, residual: [N, D] with unit column stride. own: this rank's symmetric buffer; bufs:
    int64 [world], every rank's (own's and its peers' copies) as addresses in this process,
    16-byte aligned: 2 x world slots of ``slot_elems`` of x's dtype (slot
    (parity, source rank)), all bytes 0xFF (SENTINEL) at start; epochs: int64 [max programs],
    this rank's own, zero at start. Every rank must make the same calls in the same order.
    ``pushed``: the GEMV that computed x pushed it to the peers already (a `LamportPush`)."""
    n_rows, d = x.shape
    world = bufs.numel()
    assert x.stride(1) == 1 and n_rows * d <= slot_elems, (x.stride(), n_rows, slot_elems)
    assert own.data_ptr() % 16 == 0 and own.numel() * own.element_size() >= (
        2 * bufs.numel() * slot_elems * x.element_size()
    ), (own.data_ptr(), own.numel())
    own = own.view(x.dtype)
    assert programs(n_rows, d) <= epochs.numel()
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if n_rows == 0:
        return out, res_out
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
    block_m, block_n, num_warps = row_tile(d)
    _all_reduce_add_rms_norm_kernel[(programs(n_rows, d),)](
        x, residual if residual is not None else x, weight, out, res_out, own, bufs, epochs,
        n_rows, d, x.stride(0), residual.stride(0) if residual is not None else 0, slot_elems,
        eps, RANK=rank, WORLD=world, WORLD_P2=triton.next_power_of_2(world),
        ELEM_BYTES=x.element_size(),
        HAS_RES=residual is not None, PUSHED=pushed, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps, enable_fp_fusion=False, **pdl_args(),
    )  # fmt: skip
    return out, res_out
