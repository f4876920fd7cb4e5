"""Attention backend interface: metadata prepared once per batch, a forward per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from minisgl.kvcache.pool import KVPool


@dataclass
class BatchLayout:
    """Where each request of a forward batch sits; built on the host by the scheduler.

    Row i has ``extend_lens[i]`` new tokens (1 for decode) appended after ``prefix_lens[i]``
    tokens already in the KV cache; its slot indices live in ``page_table[req_rows[i]]``.
    Host lists are kept so backends can plan without reading device memory.
    """

    req_rows: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    page_table: torch.Tensor  # [max_requests, max_context] int32/int64 slot indices, on device

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def is_decode(self) -> bool:
        return all(e == 1 for e in self.extend_lens)


@dataclass
class ForwardBatch:
    """Everything one model forward needs, passed explicitly to every layer."""

    input_ids: torch.Tensor  # [T] token ids of every new token, rows back to back
    positions: torch.Tensor  # [T] absolute positions
    out_slots: torch.Tensor  # [T] KV slot where each new token's K/V goes
    attn_backend: AttentionBackend
    attn_metadata: object
    logits_index: torch.Tensor  # [R] flat indices of the tokens whose next token is sampled


@dataclass(frozen=True)
class QKNormRope:
    """What a ``fused_kv_store`` backend needs to norm and rotate raw q/k itself: RoPE's
    ``positions`` [T] and ``cos``/``sin`` tables [max_pos, D], and the q/k RMSNorm weights
    [D] with their eps (both or neither: models without q/k norm)."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float = 1e-6


def padded_batch_size(rows: int) -> int:
    """The size a decode batch of ``rows`` is planned and CUDA-graph captured as: 1, 2, 4, 8,
    then every 8 up to 64, every 16 beyond (little padding waste where it counts). Backends
    plan a decode batch by this size, not by its row count, so that padding a batch to its
    captured graph never changes a row's plan, and greedy tokens match with graphs off."""
    if rows <= 8:
        return 1 << max(0, rows - 1).bit_length()
    if rows <= 64:
        return -(-rows // 8) * 8
    return 64 + -(-(rows - 64) // 16) * 16


class AttentionBackend(ABC):
    # True: the attention layer hands this step's raw q/k/v to ``forward_norm_rope``, which
    # norms, rotates and stores them fused (kernels/qk_rope_store.py) before ``attend``,
    # instead of calling ``forward``. Set per instance by backends that implement ``attend``.
    fused_kv_store: bool = False

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool

    @abstractmethod
    def prepare(self, layout: BatchLayout, device: torch.device) -> object:
        """Build per-batch metadata (index tensors, masks, kernel plans) once for all layers."""

    def copy_metadata(self, dst: object, src: object) -> None:
        """Copy freshly prepared metadata into the static buffers a CUDA graph captured."""
        for name, value in vars(src).items():
            target = getattr(dst, name)
            if isinstance(value, torch.Tensor):
                if value is not target:
                    target.copy_(value, non_blocking=True)
            elif name not in ("max_splits",) and value != target and not isinstance(value, bool):
                raise ValueError(f"metadata field {name} differs from the captured graph's")

    @abstractmethod
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
        """Store k/v at ``out_slots`` and attend. q: [T, Hq, D]; k, v: [T, Hk, D]; out [T, Hq*D]."""

    def attend(
        self, q: torch.Tensor, layer_id: int, metadata: object, scale: float
    ) -> torch.Tensor:
        """Attend with this step's K/V already in the pool (``fused_kv_store``): ``forward``
        without the store. q: [T, Hq, D]; out [T, Hq*D]."""
        raise NotImplementedError(f"{type(self).__name__} stores K/V in forward only")

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
        """``fused_kv_store``: ``forward`` from raw q/k/v (strided views of the projection's
        output), q/k norm and RoPE included; the layer's cache scales must be 1.0 (the
        fused store writes values unscaled). Here one kernel norms, rotates and stores
        (bit-identical to the unfused kernels), then ``attend``; a backend may fold that
        work into its own kernels instead."""
        # Imported here so CPU-only installs never need triton.
        from minisgl.kernels.qk_rope_store import fused_qk_norm_rope_store

        pool = self.pool
        store = (pool.k(layer_id), pool.v(layer_id), out_slots)
        norm = (rope.q_weight, rope.k_weight, rope.eps)
        q = fused_qk_norm_rope_store(q, k, v, rope.positions, rope.cos, rope.sin, *store, *norm)
        return self.attend(q, layer_id, metadata, scale)
