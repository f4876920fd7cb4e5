"""Attention on our own Triton kernels: split-KV paged decode and causal paged extend."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.attention.base import AttentionBackend, BatchLayout, QKNormRope, padded_batch_size
from minisgl.attention.triton_plan import (
    MIXED_DECODE_SPLITS,
    MIXED_SPLIT_TOKENS,
    ExtendGraphShape,
    HostIndices,
    LaunchPlan,
    aligned_splits,
    decode_split_cap,
    decode_tiles,
    extend_tiles,
    plan_decode_splits,
)
from minisgl.env import FP8_KV_MODE
from minisgl.kernels import cdiv
from minisgl.kernels.attention import extend_attention
from minisgl.kernels.decode_attention import decode_attention
from minisgl.kernels.decode_fold import DecodeFold
from minisgl.kernels.fp8_kv import UPCAST, KVRead
from minisgl.kernels.staging import DeviceStager
from minisgl.kernels.store import store_kv
from minisgl.kvcache.kv_dtype import is_fp8
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


class TritonBackend(AttentionBackend):
    # CUDA graphs (engine/cuda_graph.py) take this backend only: decode launch shapes depend
    # only on the batch size, so a graph replays any same-size decode batch after refresh.

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
        fused_decode_rope: bool = False,
        fp8_mode: int | None = None,
    ) -> None:
        super().__init__(pool)
        self.stager = stager
        # On for CUDA runs (AttentionBackend.fused_kv_store); with fused_decode_rope, pure
        # decode steps norm, rotate and store q/k/v inside the decode kernel.
        self.fused_kv_store = fused_kv_store
        self.fused_decode_rope = fused_decode_rope
        self.max_kv_splits = max_kv_splits
        self.min_split_tokens = min_split_tokens
        self.mixed_split_tokens = mixed_split_tokens
        self.num_sms = num_sms
        self.decode_block_n = decode_block_n
        # Overrides exist so tests can force many small tiles; None = per-head-dim defaults.
        self.extend_block_m = extend_block_m
        self.extend_block_n = extend_block_n
        # fp8 caches under 16-bit models: fp8_kv.py's conversion mode (MINISGL_FP8_KV_MODE).
        self.fp8_mode = int(FP8_KV_MODE.get()) if fp8_mode is None else fp8_mode
        self._kv_f16 = is_fp8(pool.dtype) and self.fp8_mode != UPCAST

    def _decode_tiles(self, max_splits: int) -> tuple[int, int, int]:
        block_n, warps, stages = decode_tiles(max_splits, self._kv_f16)
        return (self.decode_block_n or block_n), warps, stages

    def kv_read(self, layer_id: int) -> KVRead:
        """How the kernels read layer ``layer_id``'s cache: its scales, the fp8 mode."""
        pool = self.pool
        return KVRead(pool.k_scales[layer_id], pool.v_scales[layer_id], self.fp8_mode)

    def _sm_count(self, device: torch.device) -> int:
        if self.num_sms is None:  # interpreter runs: 8, a small split axis
            props = torch.cuda.get_device_properties
            self.num_sms = props(device).multi_processor_count if device.type == "cuda" else 8
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
            aligned_splits(n, w, block_n) if n else 0 for n, w in zip(seq_lens, want)
        ]

    def refresh(
        self,
        dst: TritonMetadata,
        layout: BatchLayout,
        device: torch.device,
        pad: ExtendGraphShape | None = None,
    ) -> None:
        """Write ``layout``'s metadata into captured ``dst`` in place: a CUDA graph captured
        on ``dst`` then replays ``layout`` (one host-to-device copy, straight into it)."""
        fresh = self._plan(layout, device, pad)
        assert dst.is_decode == fresh.is_decode and dst.batch == fresh.batch
        assert dst.block_m == fresh.block_m and dst.max_splits == fresh.max_splits
        assert dst.dec_rows == fresh.dec_rows
        assert dst.page_table is layout.page_table, "graphs read the engine's one page table"
        self._stager(device).stage_into(dst.packed, fresh.host.fields())

    def _stager(self, device: torch.device) -> DeviceStager:
        return self.stager if self.stager is not None else DeviceStager(device)

    def _prepare(
        self, layout: BatchLayout, device: torch.device, pad: ExtendGraphShape | None
    ) -> TritonMetadata:
        plan = self._plan(layout, device, pad)
        # One host-to-device copy for every index the kernels need (views of one buffer:
        # refresh rewrites a captured graph's with one copy).
        flat, parts = self._stager(device).stage_flat(plan.host.fields(), torch.int32)
        return TritonMetadata(
            is_decode=plan.is_decode,
            batch=plan.batch,
            page_table=layout.page_table,
            row_ids=parts[0],
            prefix_lens=parts[1],
            extend_lens=parts[2],
            seq_lens=parts[3],
            extend_starts=parts[4],
            num_splits=parts[5],
            max_splits=plan.max_splits,
            block_batch=parts[6],
            block_qstart=parts[7],
            block_m=plan.block_m,
            block_n=plan.block_n,
            num_warps=plan.warps,
            packed=flat,
            dec_rows=plan.dec_rows,
            dec_row_ids=parts[8],
            dec_seq_lens=parts[9],
            dec_tokens=parts[10],
        )

    def _plan(
        self, layout: BatchLayout, device: torch.device, pad: ExtendGraphShape | None
    ) -> LaunchPlan:
        host = HostIndices.of(layout)
        bsz = len(host.ext)
        is_decode = layout.is_decode and pad is None
        block_m, block_n, warps = extend_tiles(self.pool.head_dim, max(host.ext))
        max_splits = self.max_kv_splits
        if is_decode:
            max_splits, host.splits = self._plan_decodes(host.seq, device)
        else:
            block_m = pad.block_m if pad is not None else (self.extend_block_m or block_m)
            block_n = self.extend_block_n or block_n
            host.split_extend(layout.req_rows, block_m)
            if pad is not None:
                host.pad_decode_rows(pad.rows)
            if host.dec_ids:
                max_splits, host.splits = self._plan_mixed_decodes(host.dec_seq)
        if pad is not None:
            host.pad_rows(pad)
        batch = bsz if pad is None else pad.rows
        return LaunchPlan(host, is_decode, batch, max_splits, block_m, block_n, warps)

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
        pool = self.pool
        scales = (pool.k_scales[layer_id], pool.v_scales[layer_id])
        store_kv(pool.k(layer_id), pool.v(layer_id), k, v, out_slots, *scales)
        return self.attend(q, layer_id, metadata, scale)

    def forward_norm_rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: QKNormRope,
        layer_id: int,
        out_slots: torch.Tensor,
        metadata: object,
        scale: float,
    ) -> torch.Tensor:
        assert isinstance(metadata, TritonMetadata)
        if not (self.fused_decode_rope and metadata.is_decode):
            return super().forward_norm_rope(q, k, v, rope, layer_id, out_slots, metadata, scale)
        # A pure decode step: one launch fewer per layer at batch 1 (kernels/decode_fold.py).
        norm = (rope.q_weight, rope.k_weight, rope.eps)
        fold = DecodeFold(k, v, out_slots, rope.positions, rope.cos, rope.sin, *norm)
        return self.attend(q, layer_id, metadata, scale, fold)

    def attend(
        self,
        q: torch.Tensor,
        layer_id: int,
        metadata: object,
        scale: float,
        fold: DecodeFold | None = None,
    ) -> torch.Tensor:
        """``fold``: a decode step's raw q and its new k/v (forward_norm_rope)."""
        md = metadata
        assert isinstance(md, TritonMetadata)
        k, v, kv = self.pool.k(layer_id), self.pool.v(layer_id), self.kv_read(layer_id)
        # The decode kernel's plan: KV chunks per row, the grid's split axis, the scale, and
        # its (block_n, warps, stages).
        plan = (md.num_splits, md.max_splits, scale, *self._decode_tiles(md.max_splits))
        if md.is_decode:
            table, rows, lens = md.page_table, md.row_ids, md.seq_lens
            return decode_attention(q, k, v, table, rows, lens, *plan, kv=kv, fold=fold)
        assert fold is None, "only pure decode steps fold q/k norm and RoPE into attention"
        out = extend_attention(
            q,
            k,
            v,
            md.page_table,
            md.row_ids,
            md.prefix_lens,
            md.extend_lens,
            md.extend_starts,
            md.block_batch,
            md.block_qstart,
            scale,
            md.block_m,
            md.block_n,
            md.num_warps,
            kv=kv,
        )
        if md.dec_rows:  # the one-token rows of a mixed batch, into the same output
            dec = (md.dec_row_ids, md.dec_seq_lens, *plan, md.dec_tokens, out.view(q.shape))
            decode_attention(q, k, v, md.page_table, *dec, kv=kv)
        return out
