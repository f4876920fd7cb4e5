"""FlashInfer attention (``--attention-backend flashinfer``, when the optional package
``flashinfer-python`` is installed; CUDA, bf16/fp16).

The pool is handed to FlashInfer as a paged KV cache whose pages are single token slots
([slots, 1, Hk, D] views of the pool's K and V): the page table already lists each token's
slot, so any ``--page-size`` works unchanged. A batch's KV indices are gathered from the
page table on the device (no Python loop over tokens). Decode batches run FlashInfer's batch
decode kernel; prefill and mixed batches its batch prefill kernel over the paged cache
(causal: query i of a row with n new tokens sees the row's first len - n + i + 1 keys).

Each wrapper is planned once per batch, at its first layer (the scale comes with the
call), on the forward's stream: the plan's copies queue behind the previous step's kernels.
CUDA graphs stay with the triton backend; this one runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.attention.base import AttentionBackend, BatchLayout
from minisgl.kvcache.pool import KVPool

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended split-KV workspace


@dataclass
class PagedIndices:
    """A batch's paged-KV description in FlashInfer's terms (pages = token slots)."""

    qo_indptr: torch.Tensor  # [B + 1] int32, host: new-token offsets
    kv_indptr: torch.Tensor  # [B + 1] int32, host: KV offsets into kv_indices
    kv_indices: torch.Tensor  # [sum(seq_lens)] int32, device: each key's slot
    last_page_len: torch.Tensor  # [B] int32, host: all 1 (one token per page)


def paged_indices(layout: BatchLayout, device: torch.device) -> PagedIndices:
    seq_lens = layout.seq_lens
    qo = torch.tensor([0, *layout.extend_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    kv = torch.tensor([0, *seq_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    total = int(kv[-1])
    lens = torch.tensor(seq_lens, dtype=torch.long).to(device, non_blocking=True)
    rows = torch.tensor(layout.req_rows, dtype=torch.long).to(device, non_blocking=True)
    starts = kv[:-1].to(torch.long).to(device, non_blocking=True)
    # Key j of the batch belongs to row r = row_of[j], at position j - starts[r] of it.
    # output_size: with the lengths on the device, repeat_interleave would read them back.
    row_of = torch.repeat_interleave(
        torch.arange(len(seq_lens), device=device), lens, output_size=total
    )
    pos = torch.arange(total, device=device) - starts[row_of]
    indices = layout.page_table[rows[row_of], pos].to(torch.int32)
    ones = torch.ones(len(seq_lens), dtype=torch.int32)
    return PagedIndices(qo, kv, indices, ones)


@dataclass
class FlashInferMetadata:
    indices: PagedIndices
    decode: bool
    planned: bool = False


class FlashInferBackend(AttentionBackend):
    def __init__(self, pool: KVPool, device: torch.device) -> None:
        super().__init__(pool)
        try:
            import flashinfer
        except ImportError as exc:
            raise ValueError(
                "attention_backend='flashinfer' needs the flashinfer package "
                "(pip install flashinfer-python)"
            ) from exc
        if device.type != "cuda":
            raise ValueError("attention_backend='flashinfer' runs on CUDA only")
        if pool.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            # The extension's configuration check refuses this first; kept for backends
            # built by hand.
            raise ValueError(
                "attention_backend='flashinfer' does not support an fp8 KV cache: use "
                "--kv-cache-dtype auto, or the triton attention backend"
            )
        if pool.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"attention_backend='flashinfer' needs a 16-bit dtype (bfloat16 or float16), "
                f"not {pool.dtype}"
            )
        if pool.head_dim not in (64, 128, 256):
            # Its prefill kernels have no configuration for e.g. 32 (an internal error at the
            # first prefill, seen on the H200 with flashinfer-python 0.6.0).
            raise ValueError(
                f"attention_backend='flashinfer' supports head_dim 64, 128 or 256, "
                f"not {pool.head_dim}"
            )
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        # FA2 kernels: FlashInfer JIT-compiles on first use, and these build in far less
        # time than its Hopper (FA3) ones.
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            workspace, "NHD", backend="fa2"
        )
        self._plan_copied: dict[bool, torch.cuda.Event] = {}  # see _plan

    def prepare(self, layout: BatchLayout, device: torch.device) -> FlashInferMetadata:
        return FlashInferMetadata(paged_indices(layout, device), layout.is_decode)

    def _plan(self, md: FlashInferMetadata, num_heads: int, scale: float) -> None:
        # plan() writes the plan into the wrapper's pinned host buffer and queues its copy to
        # the device. With overlap scheduling the next batch is planned while the previous
        # one may still wait for the GPU, its copy not yet made: overwriting the buffer then
        # corrupts that batch's plan (upstream mini-sglang #103: illegal memory accesses).
        # So wait until this wrapper's previous copy is done.
        copied = self._plan_copied.get(md.decode)
        if copied is not None:
            copied.synchronize()
        p, pool = md.indices, self.pool
        common = dict(q_data_type=pool.dtype, kv_data_type=pool.dtype, sm_scale=scale)
        heads = (num_heads, pool.num_kv_heads, pool.head_dim, 1)  # 1: tokens per page
        if md.decode:
            self._decode.plan(p.kv_indptr, p.kv_indices, p.last_page_len, *heads, **common)
        else:
            kv = (p.kv_indptr, p.kv_indices, p.last_page_len)
            self._prefill.plan(p.qo_indptr, *kv, *heads, causal=True, **common)
        copied = torch.cuda.Event()
        copied.record()
        self._plan_copied[md.decode] = copied
        md.planned = True

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
        md = metadata
        assert isinstance(md, FlashInferMetadata)
        self.pool.store(layer_id, out_slots, k, v)
        if not md.planned:
            self._plan(md, q.shape[1], scale)
        cache = (self.pool.k(layer_id).unsqueeze(1), self.pool.v(layer_id).unsqueeze(1))
        wrapper = self._decode if md.decode else self._prefill
        out = wrapper.run(q.contiguous(), cache)
        return out.reshape(q.shape[0], -1)
