"""Block alignment of the routed (token, expert) pairs for the fused MoE (kernels/moe.py).

The T x top_k pairs are grouped by expert, in pair order within each expert (what a stable
sort by expert gives), and each expert's run is padded to a multiple of BLOCK_M, so every
M-block of the grouped GEMM belongs to one expert. Two small Triton kernels around one torch
cumsum, with no host sync: the outputs are sized from the worst case, which depends on the
pair count alone, so decode steps can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels import cdiv
from minisgl.kernels.pdl import pdl_args, pdl_wait


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst-case length after padding each expert's run to ``block_m``; at most
    min(E, P) experts are non-empty, each wasting at most block_m - 1 slots."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


def align_chunk(e_pow2: int) -> int:
    """Pairs per program: each holds a [chunk, experts] one-hot in registers (8,192 entries)."""
    return max(16, min(128, 8192 // e_pow2))


@triton.jit(do_not_specialize=["num_pairs", "max_padded"])
def _align_count_kernel(
    ids_ptr, chunk_counts_ptr, sorted_ptr, num_pairs, max_padded,
    E_POW2: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Per chunk of pairs, its pairs per expert; the programs also fill every slot of the
    sorted pairs with the padding value (the place kernel, next on the stream, overwrites)."""
    pid = tl.program_id(0)
    experts = tl.arange(0, E_POW2)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    pdl_wait(PDL)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=E_POW2)  # E_POW2: no expert
    hot = (ids[:, None] == experts[None, :]).to(tl.int32)
    tl.store(chunk_counts_ptr + experts * tl.num_programs(0) + pid, tl.sum(hot, axis=0))
    for s0 in range(pid * CHUNK, max_padded, tl.num_programs(0) * CHUNK):
        slots = s0 + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + slots, num_pairs, mask=slots < max_padded)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _align_place_kernel(
    ids_ptr, chunk_counts_ptr, counts_through_ptr, sorted_ptr, block_expert_ptr,
    num_padded_ptr, num_pairs, num_blocks, NUM_EXPERTS: tl.constexpr,
    E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Each pair of a chunk to its expert's padded start + its rank among that expert's pairs
    (pair order: a stable sort by expert); the experts of the blocks; the padded length."""
    pid = tl.program_id(0)
    experts = tl.arange(0, E_POW2)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    pdl_wait(PDL)
    # Both [E_POW2, chunks]; counts_through: chunk_counts summed over chunks 0..c (column c),
    # so its last column counts all pairs.
    chunks = tl.num_programs(0)
    counts = tl.load(counts_through_ptr + experts * chunks + chunks - 1)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    mine = tl.load(chunk_counts_ptr + experts * chunks + pid)
    earlier = tl.load(counts_through_ptr + experts * chunks + pid) - mine
    base = padded_end - padded + earlier  # this chunk's first slot per expert
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=E_POW2)
    hot = (ids[:, None] == experts[None, :]).to(tl.int32)
    rank = tl.cumsum(hot, axis=0) - hot  # earlier pairs of this chunk with the same expert
    slot = tl.sum(hot * (rank + base[None, :]), axis=1)
    tl.store(sorted_ptr + slot, offs.to(tl.int32), mask=offs < num_pairs)
    if pid == 0:
        tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    # Block b's expert: how many experts' runs end at or before its first slot (the blocks
    # past the padded length get the last expert; the GEMM skips them).
    for b0 in range(pid * CHUNK, num_blocks, tl.num_programs(0) * CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        ended = padded_end[None, :] <= (blocks * BLOCK_M)[:, None]
        owner = tl.minimum(tl.sum(ended.to(tl.int32), axis=1), NUM_EXPERTS - 1)
        tl.store(block_expert_ptr + blocks, owner, mask=blocks < num_blocks)


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the flattened (token, k) pairs by expert, each run padded to ``block_m``.

    Returns ``sorted_pairs`` [max_padded] int32 (pair index t * top_k + k, or P for padding),
    ``block_expert`` [max_padded / block_m] int32 (expert of each block; the last expert for
    unused blocks, which the kernel skips) and ``num_padded`` [1] int32 (real padded length).
    Two small kernels around one torch cumsum (the chunks' counts before each chunk), no
    host sync: what a stable sort by expert gives, without the sort.
    """
    flat = topk_ids.reshape(-1).contiguous()  # the kernels index it flat
    num_pairs, dev = flat.numel(), flat.device
    max_padded = max_padded_pairs(num_pairs, num_experts, block_m)
    num_blocks = cdiv(max_padded, block_m)
    e_pow2 = triton.next_power_of_2(num_experts)
    chunk = align_chunk(e_pow2)
    chunks = max(1, cdiv(num_pairs, chunk))
    chunk_counts = torch.empty(e_pow2, chunks, dtype=torch.int32, device=dev)
    sorted_pairs = torch.empty(max_padded, dtype=torch.int32, device=dev)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    _align_count_kernel[(chunks,)](
        flat, chunk_counts, sorted_pairs, num_pairs, max_padded, E_POW2=e_pow2, CHUNK=chunk,
        **pdl_args(),
    )  # fmt: skip
    # Along the contiguous dimension: torch scans an outer one a thread per column, serially.
    counts_through = torch.cumsum(chunk_counts, 1, dtype=torch.int32)
    _align_place_kernel[(chunks,)](
        flat, chunk_counts, counts_through, sorted_pairs, block_expert, num_padded, num_pairs,
        num_blocks, NUM_EXPERTS=num_experts, E_POW2=e_pow2, BLOCK_M=block_m,
        CHUNK=chunk, **pdl_args(),
    )  # fmt: skip
    return sorted_pairs, block_expert, num_padded
