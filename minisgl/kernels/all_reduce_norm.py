"""Tensor-parallel all-reduce fused with the residual add and RMSNorm that follow it.

In a TP decoder every o_proj and down_proj output is all-reduced and then goes straight into
``norm(x + residual)``. At batch 1 both are tiny, latency-bound kernels (Qwen3-8B at TP=2:
73 of each per token), so this does the two in one kernel over GPU peer memory (NVLink):

1. each program copies its rows of this rank's partial sum into this rank's symmetric
   buffer, in the slot of this call's parity;
2. it raises its flag in every peer's flag array (release, system scope) and waits until
   every peer has raised the same flag in its own (acquire);
3. it reads every rank's rows (the peers' through NVLink), sums them in rank order, so
   every rank gets the same bits, and then adds the residual and normalises exactly as
   kernels/norm.py does (same tile shape, no FMA contraction): results equal the unfused
   all-reduce followed by ``fused_add_rms_norm`` for two ranks (a + b rounds once either way).

Flags are epochs: program p keeps a counter in ordinary memory that it alone increments, one
call at a time, and every rank makes the same calls with the same grids, so epochs agree
across ranks without any host state (CUDA graphs replay it unchanged). Slots alternate by
epoch parity: a rank overwrites slot s at epoch e + 2 only after every peer reached epoch
e + 1, which each started after finishing epoch e (stream order), so no peer still reads s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels import cdiv
from minisgl.kernels.norm import row_tile
from minisgl.kernels.pdl import pdl_args, pdl_wait


@triton.jit(do_not_specialize=["n_rows"])
def _all_reduce_add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, bufs_ptr, flags_ptr, epochs_ptr,
    n_rows, n_cols, stride_x, stride_r, slot_elems, eps,
    RANK: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr, MAX_PROGRAMS: tl.constexpr,
    HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    dtype = x_ptr.dtype.element_ty
    # Before the PDL wait, only what no kernel writes (kernels/pdl.py): every rank's buffer
    # and flag-array addresses and the norm weight, so that no load of theirs sits on the
    # chain after the wait (the copy, the flag exchange, the peers' rows, the norm).
    ranks = tl.arange(0, WORLD_P2)
    buf_addrs = tl.load(bufs_ptr + ranks, mask=ranks < WORLD, other=0)
    flag_addrs = tl.load(flags_ptr + ranks, mask=ranks < WORLD, other=0)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    pdl_wait(PDL)

    epoch = tl.load(epochs_ptr + pid) + 1
    tl.store(epochs_ptr + pid, epoch)
    buf_off = (epoch % 2) * slot_elems + (rows * n_cols)[:, None] + cols[None, :]
    x = tl.load(x_ptr + (rows * stride_x)[:, None] + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:  # requested now, so that it arrives while the ranks exchange flags
        r = tl.load(res_ptr + (rows * stride_r)[:, None] + cols[None, :], mask=mask, other=0.0)
    own_buf = _pick(buf_addrs, ranks, RANK).to(tl.pointer_type(dtype))
    tl.store(own_buf + buf_off, x, mask=mask)
    # Every thread's copy is done before the flag goes up (the barrier, then one release
    # at system scope, which covers the writes the barrier ordered before it).
    tl.debug_barrier()
    flag = RANK * MAX_PROGRAMS + pid
    for q in tl.static_range(WORLD):
        if q != RANK:
            peer_flags = _pick(flag_addrs, ranks, q).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(peer_flags + flag, epoch, sem="release", scope="sys")
    own_flags = _pick(flag_addrs, ranks, RANK).to(tl.pointer_type(tl.int64))
    for q in tl.static_range(WORLD):
        if q != RANK:
            seen = tl.atomic_add(own_flags + q * MAX_PROGRAMS + pid, 0, sem="acquire", scope="sys")
            while seen < epoch:
                seen = tl.atomic_add(
                    own_flags + q * MAX_PROGRAMS + pid, 0, sem="acquire", scope="sys"
                )
    tl.debug_barrier()

    # Sum in rank order, rounding after each add like a chain of dtype additions.
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for q in tl.static_range(WORLD):
        if q == RANK:
            part = x.to(tl.float32)
        else:
            peer_buf = _pick(buf_addrs, ranks, q).to(tl.pointer_type(dtype))
            part = tl.load(peer_buf + buf_off, mask=mask, other=0.0, volatile=True).to(tl.float32)
        if q == 0:
            acc = part
        else:
            acc = (acc + part).to(dtype).to(tl.float32)
    out_off = (rows * n_cols)[:, None] + cols[None, :]
    if HAS_RES:
        acc = (acc + r.to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(res_out_ptr + out_off, acc.to(dtype), mask=mask)

    var = tl.sum(acc * acc, axis=1) / n_cols
    rstd = tl.rsqrt(var + eps)
    y = (acc * rstd[:, None]).to(dtype).to(tl.float32)
    tl.store(out_ptr + out_off, (y * w[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _pick(values, index, i: tl.constexpr):
    """values[i] of a small vector already in registers (no memory access)."""
    return tl.sum(tl.where(index == i, values, 0), axis=0)


def programs(n_rows: int, n_cols: int) -> int:
    """Programs (one flag and epoch each) that a call on [n_rows, n_cols] launches."""
    return cdiv(n_rows, row_tile(n_cols)[0])


def all_reduce_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    bufs: torch.Tensor,
    flags: torch.Tensor,
    epochs: torch.Tensor,
    slot_elems: int,
    rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(sum + residual) * weight, sum + residual), sum = x summed over the ranks.

    x, residual: [N, D] with unit column stride. bufs / flags: int64 [world], every rank's
    symmetric data buffer (2 slots of ``slot_elems``) and flag array (int64
    [world, len(epochs)]) as addresses in this process; epochs: int64 [max programs], this
    rank's own, zero at start. Every rank must make the same calls in the same order."""
    n_rows, d = x.shape
    world = bufs.numel()
    assert x.stride(1) == 1 and n_rows * d <= slot_elems, (x.stride(), n_rows, slot_elems)
    assert programs(n_rows, d) <= epochs.numel()
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if n_rows == 0:
        return out, res_out
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
    block_m, block_n, num_warps = row_tile(d)
    _all_reduce_add_rms_norm_kernel[(programs(n_rows, d),)](
        x, residual if residual is not None else x, weight, out, res_out, bufs, flags, epochs,
        n_rows, d, x.stride(0), residual.stride(0) if residual is not None else 0, slot_elems,
        eps, RANK=rank, WORLD=world, WORLD_P2=triton.next_power_of_2(world),
        MAX_PROGRAMS=epochs.numel(),
        HAS_RES=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        enable_fp_fusion=False, **pdl_args(),
    )  # fmt: skip
    return out, res_out
