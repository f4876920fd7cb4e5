"""Launch plans of the Triton attention kernels (triton_backend.py): tiles per head size,
and how many KV chunks each decode row is split into. Host arithmetic only."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from minisgl.attention.base import BatchLayout
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
# The split axis of the smallest decode batches (1 to 4 rows on a 132-SM GPU, the
# backend's default max_kv_splits): decode_tiles gives them their own tile.
FEW_ROWS_SPLITS = 16


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


def decode_tiles(max_splits: int, fp8: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, warps, stages) of the decode kernel. On the offline workload's ragged
    batches (H200 sweep) unsplit rows stream KV best in 128-token tiles (3.8 TB/s vs 3.4
    with 32-token ones); split small batches prefer shorter tiles, since their chunks are
    short. ``fp8``: a one-byte cache read through fp8_kv.py's conversion (tiles of the
    same tokens hold half the bytes; loaded straight to registers, one stage). The widest
    split axis (batches of a few rows) is latency, not bandwidth: a program walks one or
    two tiles, and one 64-token tile with no pipelining stage ends soonest (bf16, batch 1,
    contexts of 200 to 4,000 tokens: benchmark/gpu/bench_decode_bs1.py, RESULTS.md)."""
    if fp8:
        if max_splits == 1:
            return 128, 4, 1
        return (64, 4, 1) if max_splits <= 4 else (32, 4, 1)
    if max_splits == 1:
        return 128, 4, 3
    if max_splits <= 4:
        return 64, 4, 2
    if max_splits >= FEW_ROWS_SPLITS:
        return 64, 4, 1
    return 32, 4, 2


@dataclass
class HostIndices:
    """A batch's index lists on the host, in the order TritonMetadata's views take them."""

    rows: list[int]
    prefix: list[int]
    ext: list[int]
    seq: list[int]
    starts: list[int]  # first flat token of each row
    splits: list[int] = field(default_factory=list)
    block_batch: list[int] = field(default_factory=list)  # extend query tiles: row
    block_qstart: list[int] = field(default_factory=list)  # and first new token in it
    dec_ids: list[int] = field(default_factory=list)  # a mixed batch's one-token rows:
    dec_seq: list[int] = field(default_factory=list)  # page-table row, length and flat
    dec_tok: list[int] = field(default_factory=list)  # token of each

    @classmethod
    def of(cls, layout: BatchLayout) -> HostIndices:
        starts = [0, *itertools.accumulate(layout.extend_lens)][:-1]
        return cls(layout.req_rows, layout.prefix_lens, layout.extend_lens, layout.seq_lens, starts)

    def split_extend(self, req_rows: list[int], block_m: int) -> None:
        """Rows of new tokens into query tiles of ``block_m``; one-token rows (decodes riding
        in a mixed batch) to the decode kernel."""
        for i, e in enumerate(self.ext):
            if e == 1:
                self.dec_ids.append(req_rows[i])
                self.dec_seq.append(self.seq[i])
                self.dec_tok.append(self.starts[i])
                continue
            for q0 in range(0, e, block_m):
                self.block_batch.append(i)
                self.block_qstart.append(q0)

    def pad_decode_rows(self, rows: int) -> None:
        """Decode rows up to ``rows``: padding rows have 0 splits, so every program of
        theirs returns at once."""
        n_pad = rows - len(self.dec_ids)
        self.dec_ids, self.dec_tok = self.dec_ids + [0] * n_pad, self.dec_tok + [0] * n_pad
        self.dec_seq = self.dec_seq + [0] * n_pad

    def pad_rows(self, pad: ExtendGraphShape) -> None:
        """Rows bsz..pad.rows are empty (0 new tokens, 0 prefix); spare tiles point at the
        last of them, so their programs exit before touching memory."""
        assert len(self.block_batch) <= pad.tiles, (len(self.block_batch), pad)
        fill = pad.rows + 1 - len(self.ext)
        total = sum(self.ext)
        self.rows = self.rows + [self.rows[0] if self.rows else 0] * fill
        self.prefix, self.ext = self.prefix + [0] * fill, self.ext + [0] * fill
        self.seq, self.starts = self.seq + [0] * fill, self.starts + [total] * fill
        spare = pad.tiles - len(self.block_batch)
        self.block_batch = self.block_batch + [pad.rows] * spare
        self.block_qstart = self.block_qstart + [0] * spare

    def fields(self) -> list[list[int]]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]


@dataclass
class LaunchPlan:
    """A batch's attention metadata on the host, before it is staged, and its launch."""

    host: HostIndices
    is_decode: bool
    batch: int
    max_splits: int
    block_m: int
    block_n: int
    warps: int

    @property
    def dec_rows(self) -> int:
        return len(self.host.dec_ids)
