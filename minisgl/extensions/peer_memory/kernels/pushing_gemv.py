"""The batch-1 GEMV of minisgl/kernels/gemv.py (no bias, not gated) that also pushes its
result to the peers: an o_proj / down_proj partial sum that goes straight into the fused
all-reduce + norm (all_reduce_norm.py, called with ``pushed=True``).

Each program stores its own output columns into every peer's slot of that call as soon as
they are summed, so the rows travel while the GEMV's other programs still run, and the
norm kernel only polls. The product is the core GEMV's arithmetic, step for step (same
tiles, same order of summation), so the pushed rows are the plain GEMV's bits
(tests/unit/extensions/peer_memory/test_all_reduce_norm.py compares them, FLAT tiles
included); a change to one is made in both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.extensions.peer_memory.kernels.all_reduce_norm import LamportPush, push, sendable
from minisgl.kernels import GemvTiles, cdiv
from minisgl.kernels.gemv import MAX_ROWS, tile_products
from minisgl.kernels.pdl import pdl_args, pdl_wait


@triton.jit(do_not_specialize=["rows"])
def _pushing_gemv_kernel(
    x_ptr, w_ptr, out_ptr, rows, n_cols, k_dim, stride_xm, stride_wn, stride_om,
    own_ptr, bufs_ptr, epochs_ptr, slot_elems,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    RANK: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
    NORM_BLOCK_M: tl.constexpr, FLAT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < rows
    n_mask = offs_n < n_cols
    dtype = out_ptr.dtype.element_ty
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    # Before the PDL wait, what no kernel writes: the first weight tile (as kernels/gemv.py)
    # and the peers' buffer addresses.
    mask0 = n_mask[:, None] & (offs_k < k_dim)[None, :]
    w0 = tl.load(w_rows + offs_k[None, :], mask=mask0, other=0.0)
    ranks = tl.arange(0, WORLD_P2)
    buf_addrs = tl.load(bufs_ptr + ranks, mask=ranks < WORLD, other=0)
    pdl_wait(PDL)
    x_mask0 = m_mask[:, None] & (offs_k < k_dim)[None, :]
    x0 = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask0, other=0.0)
    acc = tile_products(x0, w0, BLOCK_K, FLAT)
    for k0 in range(BLOCK_K, k_dim, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < k_dim
        x_off = x_ptr + offs_m[:, None] * stride_xm + kk[None, :]
        x = tl.load(x_off, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tile_products(x, w, BLOCK_K, FLAT)
    if FLAT:
        y = tl.reshape(tl.sum(acc, axis=1), [BLOCK_M, BLOCK_N])
    else:
        y = tl.sum(acc, axis=2)
    elem_bytes: tl.constexpr = dtype.primitive_bitwidth // 8
    y_out = sendable(y.to(dtype), elem_bytes)
    out_mask = m_mask[:, None] & n_mask[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y_out, mask=out_mask)
    # The epoch that row's all-reduce program will use: its counter + 1.
    epoch = tl.load(epochs_ptr + offs_m // NORM_BLOCK_M, mask=m_mask, other=0) + 1
    slot = ((epoch % 2) * WORLD + RANK) * slot_elems
    remote = slot[:, None] + offs_m[:, None] * n_cols + offs_n[None, :]
    push(own_ptr, buf_addrs, ranks, y_out, remote, out_mask, RANK, WORLD, elem_bytes)


def pushing_gemv(
    x: torch.Tensor, weight: torch.Tensor, tiles: GemvTiles, lamport: LamportPush
) -> torch.Tensor:
    """x [M, K] (M <= 4) times weight [N, K]^T -> [M, N] in x's dtype, also pushed to the
    peers for the `all_reduce_add_rms_norm` call (with ``pushed=True``) that must come next
    on this stream, on this result."""
    rows, k_dim = x.shape
    n_cols = weight.shape[0]
    assert rows <= MAX_ROWS and weight.shape[1] == k_dim and weight.stride(1) == 1
    assert lamport.own.dtype == x.dtype and rows * n_cols <= lamport.slot_elems
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, n_cols, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_m, block_n, block_k, warps, stages, flat = tiles
    world = lamport.bufs.numel()
    _pushing_gemv_kernel[(cdiv(n_cols, block_n),)](
        x, weight, out, rows, n_cols, k_dim, x.stride(0), weight.stride(0), out.stride(0),
        lamport.own, lamport.bufs, lamport.epochs, lamport.slot_elems,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, RANK=lamport.rank, WORLD=world,
        WORLD_P2=triton.next_power_of_2(world), NORM_BLOCK_M=lamport.block_m,
        FLAT=bool(flat) and block_m == 1, num_warps=warps, num_stages=stages, **pdl_args(),
    )  # fmt: skip
    return out
