"""Attention on our own Triton kernels: split-KV paged decode and causal paged extend."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.attention.base import AttentionBackend, BatchLayout, padded_batch_size
from minisgl.kernels import cdiv
from minisgl.kernels.attention import decode_attention, extend_attention
from minisgl.kernels.staging import DeviceStager
from minisgl.kernels.store import store_kv
from minisgl.kvcache.pool import KVPool


@dataclass
class TritonMetadata:
    is_decode: bool
    batch: int
    page_table: torch.Tensor  # the layout's table; kernels read token slots straight from it
    row_ids: torch.Tensor  # [B] int32 page-table row of each batch row
    prefix_lens: torch.Tensor  # [B] int32
    extend_lens: torch.Tensor  # [B] int32
    seq_lens: torch.Tensor  # [B] int32 prefix + extend
    extend_starts: torch.Tensor  # [B] int32 first flat token of each row
    num_splits: torch.Tensor  # [B] int32 KV chunks per decode row (see dec_rows)
    max_splits: int  # decode grid's split axis; fixed per backend for CUDA-graph replay
    # Mixed batches: their one-token rows run the decode kernel (a KV tile read once per KV
    # head, no 128-query tile for one query); dec_rows of them (padding included), each with
    # a page-table row, a length, a token index and num_splits. 0 = none; decode batches
    # use row_ids/seq_lens/num_splits directly.
    dec_rows: int
    dec_row_ids: torch.Tensor
    dec_seq_lens: torch.Tensor
    dec_tokens: torch.Tensor
    block_batch: torch.Tensor  # [NB] int32 row of each extend query tile (extend only)
    block_qstart: torch.Tensor  # [NB] int32 first new token of each tile within its row
    block_m: int
    block_n: int
    num_warps: int
    packed: torch.Tensor  # the one device buffer every index tensor above is a view of


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
    return [_aligned_splits(n, min(cap, cdiv(n, chunk)), block_n) for n in seq_lens]


def _aligned_splits(length: int, want: int, block_n: int) -> int:
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


class TritonBackend(AttentionBackend):
    # Decode launch shapes depend only on the batch size, so a CUDA graph captured on one
    # batch's metadata replays any same-size decode batch after copy_metadata.
    graph_capturable = True

    def __init__(
        self,
        pool: KVPool,
        *,
        max_kv_splits: int = 16,
        min_split_tokens: int = 64,
        mixed_split_tokens: int = MIXED_SPLIT_TOKENS,
        num_sms: int | None = None,
        decode_block_n: int | None = None,
        extend_block_m: int | None = None,
        extend_block_n: int | None = None,
        stager: DeviceStager | None = None,
        fused_kv_store: bool = False,
    ) -> None:
        super().__init__(pool)
        self.stager = stager
        # The engine turns this on for CUDA runs (see AttentionBackend.fused_kv_store).
        self.fused_kv_store = fused_kv_store
        self.max_kv_splits = max_kv_splits
        self.min_split_tokens = min_split_tokens
        self.mixed_split_tokens = mixed_split_tokens
        self.num_sms = num_sms
        self.decode_block_n = decode_block_n
        # Overrides exist so tests can force many small tiles; None = per-head-dim defaults.
        self.extend_block_m = extend_block_m
        self.extend_block_n = extend_block_n

    def _decode_tiles(self, max_splits: int) -> tuple[int, int, int]:
        block_n, warps, stages = decode_tiles(max_splits)
        return (self.decode_block_n or block_n), warps, stages

    def _sm_count(self, device: torch.device) -> int:
        if self.num_sms is None:
            if device.type == "cuda":
                self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
            else:
                self.num_sms = 8  # interpreter runs: keep the split axis small
        return self.num_sms

    def prepare(self, layout: BatchLayout, device: torch.device) -> TritonMetadata:
        return self._prepare(layout, device, None)

    def prepare_extend_graph(
        self, layout: BatchLayout, device: torch.device, pad: ExtendGraphShape
    ) -> TritonMetadata:
        """Extend metadata with launch shapes fixed by ``pad`` alone (a CUDA graph captured
        for that shape replays any batch that fits): rows and query tiles are padded with an
        empty row (no new tokens, no prefix), whose tiles return at once."""
        assert len(layout.extend_lens) <= pad.rows, (len(layout.extend_lens), pad)
        return self._prepare(layout, device, pad)

    def extend_graph_shape(self, tokens: int, rows: int) -> ExtendGraphShape:
        """The padded shape of an extend graph for up to ``tokens`` new tokens in ``rows``."""
        block_m = self.extend_block_m or extend_tiles(self.pool.head_dim, tokens)[0]
        # Each row's last tile may be partial: at most one tile per row beyond T / BLOCK_M.
        return ExtendGraphShape(rows, cdiv(tokens, block_m) + rows, block_m)

    def _plan_decodes(self, seq_lens: list[int], device: torch.device) -> tuple[int, list[int]]:
        """(grid split axis, splits per row) of a decode batch, planned as its padded size:
        the same plan whether or not a CUDA graph pads it. Rows that fill the GPU get 1 and
        skip the reduction."""
        hk, sms = self.pool.num_kv_heads, self._sm_count(device)
        bsz = padded_batch_size(len(seq_lens))
        max_splits = decode_split_cap(bsz, hk, sms, self.max_kv_splits)
        block_n = self._decode_tiles(max_splits)[0]
        return max_splits, plan_decode_splits(
            seq_lens, hk, sms, max_splits, self.min_split_tokens, block_n, batch=bsz
        )

    def _plan_mixed_decodes(self, seq_lens: list[int]) -> tuple[int, list[int]]:
        """(grid split axis, splits per row) of a mixed batch's one-token rows: each row's
        plan from its own length (see MIXED_DECODE_SPLITS); padding rows get 0."""
        max_splits = min(MIXED_DECODE_SPLITS, self.max_kv_splits)
        block_n = self._decode_tiles(max_splits)[0]
        want = [min(max_splits, cdiv(n, self.mixed_split_tokens)) for n in seq_lens]
        return max_splits, [
            _aligned_splits(n, w, block_n) if n else 0 for n, w in zip(seq_lens, want)
        ]

    def _prepare(
        self, layout: BatchLayout, device: torch.device, pad: ExtendGraphShape | None
    ) -> TritonMetadata:
        prefix, ext = layout.prefix_lens, layout.extend_lens
        seq = layout.seq_lens
        bsz = len(ext)
        starts, acc = [], 0
        for e in ext:
            starts.append(acc)
            acc += e
        is_decode = layout.is_decode and pad is None
        splits: list[int] = []
        block_batch: list[int] = []
        block_qstart: list[int] = []
        block_m, block_n, warps = extend_tiles(self.pool.head_dim, max(ext))
        max_splits = self.max_kv_splits
        if is_decode:
            max_splits, splits = self._plan_decodes(seq, device)
        dec_ids: list[int] = []
        dec_seq: list[int] = []
        dec_tok: list[int] = []
        if not is_decode:
            block_m = self.extend_block_m or block_m
            block_n = self.extend_block_n or block_n
            if pad is not None:
                block_m = pad.block_m
            for i, e in enumerate(ext):
                if e == 1:
                    # A one-token row (a decode riding in a mixed batch): the decode kernel.
                    dec_ids.append(layout.req_rows[i])
                    dec_seq.append(seq[i])
                    dec_tok.append(starts[i])
                    continue
                for q0 in range(0, e, block_m):
                    block_batch.append(i)
                    block_qstart.append(q0)
            if pad is not None:
                # Padding rows have 0 splits: every program of theirs returns at once.
                n_pad = pad.rows - len(dec_ids)
                dec_ids, dec_tok = dec_ids + [0] * n_pad, dec_tok + [0] * n_pad
                dec_seq = dec_seq + [0] * n_pad
            if dec_ids:
                max_splits, splits = self._plan_mixed_decodes(dec_seq)
        rows = layout.req_rows
        if pad is not None:
            # Rows bsz..pad.rows are empty (0 new tokens, 0 prefix); spare tiles point at the
            # last of them, so their programs exit before touching memory.
            assert len(block_batch) <= pad.tiles, (len(block_batch), pad)
            fill = pad.rows + 1 - bsz
            rows = rows + [rows[0] if rows else 0] * fill
            prefix, ext, seq = prefix + [0] * fill, ext + [0] * fill, seq + [0] * fill
            starts = starts + [acc] * fill
            spare = pad.tiles - len(block_batch)
            block_batch = block_batch + [pad.rows] * spare
            block_qstart = block_qstart + [0] * spare
        # One host-to-device copy for every index the kernels need, each field 16-byte
        # aligned (Triton specialises kernels on pointer alignment).
        fields = [rows, prefix, ext, seq, starts, splits, block_batch, block_qstart]
        fields += [dec_ids, dec_seq, dec_tok]
        stager = self.stager if self.stager is not None else DeviceStager(device)
        # Views of one buffer: copy_metadata refreshes a captured graph's with one copy.
        flat, parts = stager.stage_flat(fields, torch.int32)
        return TritonMetadata(
            is_decode=is_decode,
            batch=bsz if pad is None else pad.rows,
            page_table=layout.page_table,
            row_ids=parts[0],
            prefix_lens=parts[1],
            extend_lens=parts[2],
            seq_lens=parts[3],
            extend_starts=parts[4],
            num_splits=parts[5],
            max_splits=max_splits,
            block_batch=parts[6],
            block_qstart=parts[7],
            block_m=block_m,
            block_n=block_n,
            num_warps=warps,
            packed=flat,
            dec_rows=len(dec_ids),
            dec_row_ids=parts[8],
            dec_seq_lens=parts[9],
            dec_tokens=parts[10],
        )

    def copy_metadata(self, dst: object, src: object) -> None:
        """Write decode metadata ``src`` into captured ``dst`` in place (one device copy)."""
        assert isinstance(dst, TritonMetadata) and isinstance(src, TritonMetadata)
        assert dst.is_decode == src.is_decode and dst.batch == src.batch
        assert dst.packed.shape == src.packed.shape and dst.block_m == src.block_m
        assert dst.dec_rows == src.dec_rows and dst.max_splits == src.max_splits
        assert dst.page_table is src.page_table, "graphs read the engine's one page table"
        dst.packed.copy_(src.packed, non_blocking=True)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        out_slots: torch.Tensor,
        metadata: object,
        scale: float,
    ) -> torch.Tensor:
        store_kv(self.pool.k(layer_id), self.pool.v(layer_id), k, v, out_slots)
        return self.attend(q, layer_id, metadata, scale)

    def attend(
        self, q: torch.Tensor, layer_id: int, metadata: object, scale: float
    ) -> torch.Tensor:
        md = metadata
        assert isinstance(md, TritonMetadata)
        k_cache, v_cache = self.pool.k(layer_id), self.pool.v(layer_id)
        block_n, warps, stages = self._decode_tiles(md.max_splits)
        if md.is_decode:
            return decode_attention(
                q, k_cache, v_cache, md.page_table, md.row_ids, md.seq_lens, md.num_splits,
                md.max_splits, scale, block_n, warps, stages,
            )  # fmt: skip
        out = extend_attention(
            q, k_cache, v_cache, md.page_table, md.row_ids, md.prefix_lens, md.extend_lens,
            md.extend_starts, md.block_batch, md.block_qstart, scale, md.block_m, md.block_n,
            md.num_warps,
        )  # fmt: skip
        if md.dec_rows:  # the one-token rows of a mixed batch, into the same output
            decode_attention(
                q, k_cache, v_cache, md.page_table, md.dec_row_ids, md.dec_seq_lens,
                md.num_splits, md.max_splits, scale, block_n, warps, stages,
                q_index=md.dec_tokens, out=out.view(q.shape),
            )  # fmt: skip
        return out
