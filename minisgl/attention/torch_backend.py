"""Reference attention on plain torch (CPU and CUDA): gather KV through the page table,
pad the batch, and run scaled_dot_product_attention with a causal-with-prefix mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl.attention.base import AttentionBackend, BatchLayout


@dataclass
class TorchMetadata:
    kv_index: torch.Tensor  # [B, max_kv] slot indices (padding points at slot 0, masked)
    q_pad_index: torch.Tensor  # [B * max_q] position in the flat token array, or T for padding
    q_unpad_index: torch.Tensor  # [T] position of each real token in the padded [B * max_q]
    mask: torch.Tensor  # [B, 1, max_q, max_kv] bool, True = attend
    batch: int
    max_q: int


class TorchBackend(AttentionBackend):
    def prepare(self, layout: BatchLayout, device: torch.device) -> TorchMetadata:
        bsz = len(layout.req_rows)
        max_q = max(layout.extend_lens)
        seq_lens = layout.seq_lens
        max_kv = max(seq_lens)
        rows = torch.tensor(layout.req_rows, device=device)
        kv_index = layout.page_table[rows, :max_kv].long()
        kv_pos = torch.arange(max_kv, device=device)
        q_off = torch.arange(max_q, device=device)
        prefix = torch.tensor(layout.prefix_lens, device=device)
        ext = torch.tensor(layout.extend_lens, device=device)
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
        starts = torch.cumsum(ext, 0) - ext
        flat = starts[:, None] + q_off[None, :]
        total = int(sum(layout.extend_lens))
        q_pad_index = torch.where(valid_q, flat, total).reshape(-1)
        q_unpad_index = (torch.arange(bsz, device=device)[:, None] * max_q + q_off[None, :])[
            valid_q
        ]
        return TorchMetadata(kv_index, q_pad_index, q_unpad_index, mask.unsqueeze(1), bsz, max_q)

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
        self.pool.store(layer_id, out_slots, k, v)
        num_tokens, hq, d = q.shape
        k_all = self.pool.k(layer_id)[md.kv_index]  # [B, max_kv, Hk, D]
        v_all = self.pool.v(layer_id)[md.kv_index]
        hk = k_all.shape[2]
        q_ext = torch.cat([q, q.new_zeros(1, hq, d)], dim=0)
        q_pad = q_ext[md.q_pad_index].view(md.batch, md.max_q, hq, d).transpose(1, 2)
        k_all = k_all.transpose(1, 2).to(q.dtype)
        v_all = v_all.transpose(1, 2).to(q.dtype)
        out = F.scaled_dot_product_attention(
            q_pad, k_all, v_all, attn_mask=md.mask, scale=scale, enable_gqa=hk != hq
        )
        out = out.transpose(1, 2).reshape(md.batch * md.max_q, hq * d)
        return out[md.q_unpad_index]
