"""The preallocated KV pool: one tensor holding every layer's K and V token slots."""

from __future__ import annotations

import torch

from minisgl.kvcache.kv_dtype import is_fp8, to_kv_dtype


class KVPool:
    """K and V for ``num_pages * page_size`` token slots per layer, NHD layout per slot.

    A slot index is ``page_id * page_size + offset``; page tables store slot indices, so
    attention can gather any token regardless of the page size. ``dtype`` may be an fp8 type
    (``--kv-cache-dtype``, see kv_dtype.py): stores saturate into it, readers upcast.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.buffer = torch.zeros(
            2, num_layers, self.num_slots, num_kv_heads, head_dim, dtype=dtype, device=device
        )
        # Per-layer scales of an fp8 cache (kv_dtype.py): a slot holds value / scale.
        self.k_scales = [1.0] * num_layers
        self.v_scales = [1.0] * num_layers
        # One event per layer of KV being copied in on a side stream (a tier loading a
        # prefix back, tier.py); attention waits on its layer's. None: nothing ever loaded.
        self.layer_events: list[torch.cuda.Event] | None = None

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait until ``layer``'s K/V copied in has landed."""
        if self.layer_events is not None:
            torch.cuda.current_stream().wait_event(self.layer_events[layer])

    def wait_all_layers(self) -> None:
        """Before a CUDA graph replays: the graph cannot wait per layer."""
        if self.layer_events is not None:
            torch.cuda.current_stream().wait_event(self.layer_events[-1])

    def k(self, layer: int) -> torch.Tensor:
        return self.buffer[0, layer]

    def v(self, layer: int) -> torch.Tensor:
        return self.buffer[1, layer]

    def read(self, layer: int, index: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """K and V of the slots ``index`` (any shape) as ``dtype``, times their scales."""
        k, v = self.k(layer)[index].to(dtype), self.v(layer)[index].to(dtype)
        if self.k_scales[layer] != 1.0:
            k = k * self.k_scales[layer]
        if self.v_scales[layer] != 1.0:
            v = v * self.v_scales[layer]
        return k, v

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_scale, v_scale = self.k_scales[layer], self.v_scales[layer]
        if k_scale != 1.0 or v_scale != 1.0:
            k, v = k.float() * (1.0 / k_scale), v.float() * (1.0 / v_scale)  # as store_kv
        k, v, dst = to_kv_dtype(k, self.dtype), to_kv_dtype(v, self.dtype), self.buffer
        if is_fp8(self.dtype):
            # index_copy_ has no fp8 kernel on CPU: copy the bytes instead.
            k, v, dst = k.view(torch.uint8), v.view(torch.uint8), dst.view(torch.uint8)
        dst[0, layer].index_copy_(0, slots, k)
        dst[1, layer].index_copy_(0, slots, v)

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * elem
