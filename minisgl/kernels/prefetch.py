"""L2 prefetch of a weight (Hopper's bulk copy engine): a decode step at small batch reads
every weight once from HBM, back to back, and between the GEMVs run kernels that hardly use
the memory bus (RoPE, attention over a short context, norms, the TP all-reduce). A prefetch
launched before such a stretch asks the copy engine to pull the next GEMV's weight into L2
while they run; the GEMV then reads it from L2.

The kernel only issues `cp.async.bulk.prefetch.L2` requests (fire-and-forget: no register or
shared memory receives the data, nothing waits for it) and exits, so it costs a launch on
the critical path, not the transfer. It writes nothing: results are bit-identical with it on
or off. Needs sm_90; never run under Triton's interpreter (it is inline PTX).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.pdl import pdl_args, pdl_wait

# Bytes per bulk request, and requests per program (one per thread of its single warp).
CHUNK_BYTES = 32 * 1024
REQUESTS = 32


@triton.jit
def _l2_prefetch_kernel(base, total, CHUNK: tl.constexpr, REQ: tl.constexpr, PDL: tl.constexpr):
    # Waiting keeps the stream's PDL chain transitive: the kernel after this one waits only
    # for this grid, which must therefore not finish before the one before it.
    pdl_wait(PDL)
    idx = tl.program_id(0) * REQ + tl.arange(0, REQ)
    start = idx.to(tl.int64) * CHUNK
    size = tl.minimum(total - start, CHUNK).to(tl.int32)  # <= 0 past the end: skipped
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [base + start, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def prefetch_l2(weight: torch.Tensor, max_bytes: int | None = None) -> None:
    """Ask for the first ``max_bytes`` (all by default) of a contiguous CUDA tensor in L2."""
    assert weight.is_cuda and weight.is_contiguous()
    total = weight.numel() * weight.element_size()
    if max_bytes is not None:
        total = min(total, max_bytes)
    total -= total % 16  # bulk sizes are multiples of 16 bytes (the tail stays in HBM)
    if total <= 0:
        return
    per_program = CHUNK_BYTES * REQUESTS
    _l2_prefetch_kernel[(triton.cdiv(total, per_program),)](
        weight.data_ptr(), total, CHUNK=CHUNK_BYTES, REQ=REQUESTS, num_warps=1, **pdl_args()
    )
