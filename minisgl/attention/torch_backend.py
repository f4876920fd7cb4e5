"""Reference attention on plain torch (CPU and CUDA): gather KV through the page table,
pad the batch, and run scaled_dot_product_attention with a causal-with-prefix mask.

A mixed batch is padded in two groups, its one-token rows (decodes) and its longer rows:
padded together, every decode row would be padded to the longest prompt chunk (11 rows
beside a 300-token chunk cost 11 prefills; on the CPU that made mixed batches 1.3x slower
under load, benchmark/RESULTS.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl.attention.base import AttentionBackend, BatchLayout
from minisgl.kernels import cpu


@dataclass
class PaddedGroup:
    kv_index: torch.Tensor  # [B, max_kv] slot indices (padding points at slot 0, masked)
    q_pad_index: torch.Tensor  # [B * max_q] position in the flat token array, or T for padding
    q_unpad_index: torch.Tensor  # [n] position of each real query in the padded [B * max_q]
    tokens: torch.Tensor | None  # [n] flat token of each real query; None = all, in order
    mask: torch.Tensor  # [B, 1, max_q, max_kv] bool, True = attend
    batch: int
    max_q: int
    seq_lens: torch.Tensor  # [B] int64: cached tokens of each row, this step's included


@dataclass
class TorchMetadata:
    groups: list[PaddedGroup]
    num_tokens: int


def _to_device(values: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host values on the device without a host sync: a plain ``torch.tensor(values,
    device=...)`` waits for the stream after its pageable copy (so would drain the device
    under overlap scheduling); the asynchronous copy stages the values before it returns."""
    return torch.as_tensor(values).to(device, non_blocking=True)


def _pad_group(
    layout: BatchLayout, rows: list[int], starts: list[int], total: int, device: torch.device
) -> PaddedGroup:
    """Padded attention inputs for batch rows ``rows`` (indices into the layout)."""
    exts = [layout.extend_lens[i] for i in rows]
    prefixes = [layout.prefix_lens[i] for i in rows]
    bsz, max_q = len(rows), max(exts)
    max_kv = max(p + e for p, e in zip(prefixes, exts))
    table_rows = _to_device([layout.req_rows[i] for i in rows], device)
    kv_index = layout.page_table[table_rows, :max_kv].long()
    kv_pos = torch.arange(max_kv, device=device)
    q_off = torch.arange(max_q, device=device)
    prefix = _to_device(prefixes, device)
    ext = _to_device(exts, device)
    seq = prefix + ext
    # Query i of row b sits at absolute position prefix[b] + i and sees keys <= that.
    q_abs = prefix[:, None] + q_off[None, :]
    mask = (kv_pos[None, None, :] <= q_abs[:, :, None]) & (
        kv_pos[None, None, :] < seq[:, None, None]
    )
    valid_q = q_off[None, :] < ext[:, None]  # [B, max_q]
    mask &= valid_q[:, :, None]
    # Padded query rows must still see one key, or softmax yields NaN.
    mask[..., 0] |= ~valid_q
    kv_index = torch.where(kv_pos[None, :] < seq[:, None], kv_index, 0)
    # Boolean-mask indexing on the device would sync the host (its size is data-dependent):
    # the gather indices are built from the host's lengths and copied over instead.
    host_off = torch.arange(max_q)
    host_valid = host_off[None, :] < torch.tensor(exts)[:, None]
    host_flat = torch.tensor([starts[i] for i in rows])[:, None] + host_off[None, :]
    q_pad_index = torch.where(valid_q, _to_device(host_flat, device), total).reshape(-1)
    q_unpad = (torch.arange(bsz)[:, None] * max_q + host_off[None, :])[host_valid]
    in_order = rows == list(range(len(layout.req_rows)))
    tokens = None if in_order else _to_device(host_flat[host_valid], device)
    q_unpad_index = _to_device(q_unpad, device)
    group = (kv_index, q_pad_index, q_unpad_index, tokens, mask.unsqueeze(1), bsz, max_q, seq)
    return PaddedGroup(*group)


class TorchBackend(AttentionBackend):
    def prepare(self, layout: BatchLayout, device: torch.device) -> TorchMetadata:
        ext = layout.extend_lens
        starts, acc = [], 0
        for e in ext:
            starts.append(acc)
            acc += e
        one = [i for i, e in enumerate(ext) if e == 1]
        longer = [i for i, e in enumerate(ext) if e != 1]
        parts = [one, longer] if one and longer else [list(range(len(ext)))]
        return TorchMetadata([_pad_group(layout, r, starts, acc, device) for r in parts], acc)

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
        assert isinstance(md, TorchMetadata)
        if len(md.groups) == 1 and self._decodes_on_cpu(q, md.groups[0]):
            # One query per request: the C kernel stores this step's K/V and reads the cache
            # through the page table (no gathered, padded copy of K/V per layer).
            g, caches = md.groups[0], (self.pool.k(layer_id), self.pool.v(layer_id))
            slots = out_slots.to(torch.int64)
            return cpu.decode_attention(q, *caches, g.kv_index, g.seq_lens, scale, (k, v, slots))
        self.pool.store(layer_id, out_slots, k, v)
        num_tokens, hq, d = q.shape
        q_ext = torch.cat([q, q.new_zeros(1, hq, d)], dim=0)
        outs = [self._attend(q_ext, layer_id, g, scale) for g in md.groups]
        if len(outs) == 1 and md.groups[0].tokens is None:
            return outs[0]
        out = q.new_empty(num_tokens, hq * d)
        for g, o in zip(md.groups, outs):
            out[g.tokens] = o
        return out

    def cpu_decode_rows(self, metadata: object) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(kv_index [B, *] int64, seq_lens [B] int64) where every row of the step decodes one
        token from a float32 pool on the CPU (what the C kernels read), else None."""
        md = metadata
        if not isinstance(md, TorchMetadata) or len(md.groups) != 1:
            return None
        g = md.groups[0]
        if g.max_q != 1 or g.tokens is not None or self.pool.dtype != torch.float32:
            return None
        return g.kv_index, g.seq_lens

    def _decodes_on_cpu(self, q: torch.Tensor, g: PaddedGroup) -> bool:
        return g.max_q == 1 and g.tokens is None and cpu.fused_ok(q) and self.pool.dtype == q.dtype

    def _attend(
        self, q_ext: torch.Tensor, layer_id: int, g: PaddedGroup, scale: float
    ) -> torch.Tensor:
        hq, d = q_ext.shape[1], q_ext.shape[2]
        # [B, max_kv, Hk, D] as q's dtype (an fp8 cache upcast and times its scales)
        k_all, v_all = self.pool.read(layer_id, g.kv_index, q_ext.dtype)
        hk = k_all.shape[2]
        q_pad = q_ext[g.q_pad_index].view(g.batch, g.max_q, hq, d).transpose(1, 2)
        k_all, v_all = k_all.transpose(1, 2), v_all.transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q_pad, k_all, v_all, attn_mask=g.mask, scale=scale, enable_gqa=hk != hq
        )
        out = out.transpose(1, 2).reshape(g.batch * g.max_q, hq * d)
        return out[g.q_unpad_index]
