"""Launch plans of the Triton attention kernels (triton_backend.py): tiles per head size,
and how many KV chunks each decode row is split into. Host arithmetic only."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.kernels import cdiv


@dataclass(frozen=True)
class ExtendGraphShape:
    """Launch shape of extend attention inside a CUDA graph: row and query-tile capacity."""

    rows: int
    tiles: int
    block_m: int


def extend_tiles(head_dim: int, max_extend: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the extend kernel for Hopper-class GPUs."""
    if head_dim > 128:
        return 64, 32, 8  # keeps the fp32 accumulator and K/V tiles in registers/smem
    block_m = 64 if max_extend <= 64 else 128  # short rows waste less of a smaller tile
    return block_m, 64, 8 if head_dim > 64 else 4


# Split-KV decode plan, from the tile/plan sweep over the offline workload's real ragged
# batches (benchmark/gpu/sweep_ragged.py, benchmark/RESULTS.md): aim for about this many
# waves of SM-sized program sets. Big batches (B * Hk >= waves * SMs) are not split at all.
DECODE_WAVES = 4
# The one-token rows of a mixed batch: a row's plan must not depend on the other rows,
# since a mixed CUDA graph pads them to its row capacity (greedy tokens must not change
# with graphs off). Up to this many chunks, of at least MIXED_SPLIT_TOKENS each.
MIXED_DECODE_SPLITS = 4
MIXED_SPLIT_TOKENS = 1024


def plan_decode_splits(
    seq_lens: list[int],
    num_kv_heads: int,
    num_sms: int,
    max_splits: int,
    min_split_tokens: int,
    block_n: int,
    waves: int = DECODE_WAVES,
    batch: int | None = None,
) -> list[int]:
    """KV chunks per decode row: chunks of about equal size, so that B * Hk * splits
    programs fill about ``waves`` waves of SMs and no program runs much longer than the rest
    (a long row gets more chunks than a short one). ``batch`` (default: the row count) is
    the size the batch is planned as.

    A chunk shorter than ``min_split_tokens`` costs more in the reduction than it saves.
    The count is then shrunk so that every chunk, rounded up to ``block_n`` as the kernel
    does, is non-empty.
    """
    bsz = len(seq_lens) if batch is None else batch
    cap = decode_split_cap(bsz, num_kv_heads, num_sms, max_splits, waves)
    if cap == 1:
        return [1] * len(seq_lens)  # a big batch fills the GPU without splitting
    # KV before each row's new token: a CUDA graph's padding rows (one token) add nothing.
    total = sum(max(n - 1, 0) for n in seq_lens)
    chunk = max(min_split_tokens, cdiv(total * num_kv_heads, waves * num_sms))
    return [aligned_splits(n, min(cap, cdiv(n, chunk)), block_n) for n in seq_lens]


def aligned_splits(length: int, want: int, block_n: int) -> int:
    """``want`` chunks (at least 1), shrunk so that every chunk, rounded up to ``block_n``
    as the kernel does, is non-empty."""
    length = max(length, 1)  # padding rows of a captured graph may be empty
    aligned = cdiv(cdiv(length, max(1, want)), block_n) * block_n
    return max(1, cdiv(length, aligned))


def decode_split_cap(
    batch: int, num_kv_heads: int, num_sms: int, max_splits: int, waves: int = DECODE_WAVES
) -> int:
    """The decode grid's split axis: enough programs for about ``waves`` waves of SMs. It
    depends on the batch size only, so a CUDA graph captured per size stays valid."""
    return max(1, min(max_splits, cdiv(waves * num_sms, max(1, batch * num_kv_heads))))


def decode_tiles(max_splits: int) -> tuple[int, int, int]:
    """(BLOCK_N, warps, stages) of the decode kernel. On the offline workload's ragged
    batches (H200 sweep) unsplit rows stream KV best in 128-token tiles (3.8 TB/s vs 3.4
    with 32-token ones); split small batches prefer shorter tiles, since their chunks are
    short."""
    if max_splits == 1:
        return 128, 4, 3
    if max_splits <= 4:
        return 64, 4, 2
    return 32, 4, 2
