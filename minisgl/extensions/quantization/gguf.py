"""GGUF weights kept quantized on CPU: the ``gguf`` method of layers/quantization.py.

A GGUF file mixes block types per tensor (Q4_K_M files keep some v and down projections in
Q6_K), so a layer's weights are not known until they arrive. The loader
(models/gguf_loader.py) yields each quantized tensor's raw blocks under
``<layer>.gguf_<type>``; every layer registers an empty placeholder per supported type whose
``weight_loader`` splits the blocks into codes and scales (gguf_blocks.py) and keeps this
rank's part. Which part that is, the layer's own ``load_shard`` says: it shards a tensor of
(row, 16-input group) indices exactly as it would shard a float weight.

``finish_loading`` then packs each run of rows of one kind into a `Segment` for the AVX2
kernels of csrc/gguf_cpu.c (4-bit: Q4_0, Q4_1, Q4_K; 8-bit: Q8_0, Q6_K), which read the
weights quantized for every product. Where those kernels do not run (CUDA, no AVX2, the
extension not built, MINISGL_GGUF_KERNELS=0) the layer gets the dequantized float weight,
as before this method existed. The tied embedding / LM head is one such layer: it looks up
rows by dequantizing only the rows asked for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from torch import nn

from minisgl.extensions.quantization.gguf_blocks import SUPPORTED, split_blocks
from minisgl.extensions.quantization.gguf_kernels import (
    DEQUANT_MIN_ROWS,
    Segment,
    kernels_available,
    pack,
    tile_rows,
)
from minisgl.layers.quantization import KernelWeights, ShardFn


@dataclass
class _Part:
    """One loaded tensor's shard: rows [start, start + codes.shape[0]) of the layer."""

    start: int
    qtype: T
    codes: torch.Tensor  # int8 [rows, K]
    scale: torch.Tensor  # float32 [rows, K / 16]
    offset: torch.Tensor


@dataclass
class GGUFWeights:
    """A layer's quantized state: parts while loading, segments once packed."""

    out_features: int
    in_local: int
    dtype: torch.dtype = torch.float32  # of the model's float tensors (embedding lookups)
    parts: list[_Part] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)


def _state(layer: nn.Module) -> GGUFWeights:
    state = getattr(layer, "gguf", None)
    assert isinstance(state, GGUFWeights), "layer has no GGUF weights"
    return state


@dataclass(frozen=True)
class GGUFMethod:
    """GGUF block-quantized weights (a layers/quantization.py QuantMethod)."""

    name: str = "gguf"

    def create_weights(
        self, layer: nn.Module, out_features: int, in_local: int, in_full: int, load_shard: ShardFn
    ) -> None:
        if in_local % 32:
            raise ValueError(
                f"GGUF layers need inputs in whole 32-input groups per rank, got {in_local}"
            )
        setattr(layer, "gguf", GGUFWeights(out_features, in_local))  # noqa: B010 (not a tensor)
        for qtype in SUPPORTED:
            p = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
            p.raw_checkpoint = True  # type: ignore[attr-defined]
            p.optional = True  # type: ignore[attr-defined]
            p.weight_loader = _loader(layer, qtype, in_full, load_shard)  # type: ignore[attr-defined]
            layer.register_parameter(f"gguf_{qtype.name.lower()}", p)

    def finish_loading(self, layer: nn.Module, dtype: torch.dtype) -> bool:
        state = _state(layer)
        parts = sorted(state.parts, key=lambda p: p.start)
        device = next(p.device for p in layer.parameters() if p.dtype == torch.uint8)
        for qtype in SUPPORTED:
            delattr(layer, f"gguf_{qtype.name.lower()}")
        if device.type == "cpu" and kernels_available():
            state.segments = pack([(p.start, p.qtype, p.codes, p.scale, p.offset) for p in parts])
            state.parts, state.dtype = [], dtype
            return True
        weight = torch.cat([_dequantize(p) for p in parts]).to(device=device, dtype=dtype)
        del layer.gguf
        layer.weight = nn.Parameter(weight, requires_grad=False)
        return False

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # Runs once per layer and token at batch 1: kept to a few calls into torch.
        state = _state(layer)
        fp32 = x.dtype == torch.float32 and x.is_contiguous()
        xf = x if fp32 else x.float().contiguous()
        k = xf.shape[-1]
        m = xf.numel() // k
        out = torch.empty(*x.shape[:-1], state.out_features, dtype=torch.float32)
        if m >= DEQUANT_MIN_ROWS:
            for seg in state.segments:
                seg.matmul_dequantized(xf.view(m, k), out.view(m, -1))
        else:
            xp, op, tiles = xf.data_ptr(), out.data_ptr(), tile_rows()
            for seg in state.segments:
                seg.bound(seg.rows, state.out_features, xp, m, k, op + 4 * seg.start, tiles)
        if bias is not None:
            out += bias
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def kernel_weights(self, layer: nn.Module) -> KernelWeights | None:
        """The packed segments (layers/quantization.py's CpuKernelQuantMethod)."""
        state = _state(layer)
        if not state.segments:
            return None
        segments = tuple(seg.kernel_segment() for seg in state.segments)
        return KernelWeights(state.out_features, state.in_local, segments, DEQUANT_MIN_ROWS - 1)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the layer's weight, dequantized (the embedding lookup)."""
        state = _state(layer)
        out = torch.empty(ids.numel(), state.in_local, dtype=state.dtype)
        for seg in state.segments:
            hit = (ids >= seg.start) & (ids < seg.start + seg.rows)
            if bool(hit.any()):
                out[hit] = seg.rows_dequantized(ids[hit] - seg.start).to(state.dtype)
        return out


def parse_gguf_method(config: Mapping[str, object]) -> GGUFMethod:
    """The method for a GGUF file whose quantized ``tensor_types`` are all supported."""
    types = config.get("tensor_types") or []
    names = {t.name for t in SUPPORTED}
    unsupported = sorted(set(map(str, types if isinstance(types, list) else [])) - names)
    if unsupported:
        raise ValueError(
            f"quantization_config.tensor_types: {', '.join(unsupported)} are not kept "
            f"quantized (supported: {', '.join(sorted(names))})"
        )
    return GGUFMethod()


def _dequantize(part: _Part) -> torch.Tensor:
    """gguf-py's float32 values: scale * code + offset, per 16 inputs."""
    rows, k = part.codes.shape
    w = part.codes.float().view(rows, k // 16, 16) * part.scale[..., None] + part.offset[..., None]
    return w.view(rows, k)


def _loader(layer: nn.Module, qtype: T, in_full: int, load_shard: ShardFn) -> object:
    def load(param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        state = _state(layer)
        rows = loaded.shape[0]
        split = split_blocks(loaded.cpu().numpy(), qtype, (rows, in_full))
        # Shard (row, group) indices the way the layer shards a float weight: the result
        # says which of this tensor's rows and groups land where on this rank.
        groups = in_full // 16
        index = torch.arange(rows * groups, dtype=torch.int64).view(rows, groups)
        placed = torch.full((state.out_features, state.in_local // 16), -1, dtype=torch.int64)
        load_shard(placed, index, shard)  # type: ignore[arg-type]
        local = (placed[:, 0] >= 0).nonzero().flatten()
        if local.numel() == 0:
            return
        src = placed[local] // groups  # this tensor's row of each local row
        g0 = int(placed[local[0], 0] % groups)
        n_groups = state.in_local // 16
        k0, k1 = g0 * 16, (g0 + n_groups) * 16
        take = src[:, 0].numpy()
        state.parts.append(
            _Part(
                start=int(local[0]),
                qtype=qtype,
                codes=torch.from_numpy(np.ascontiguousarray(split.codes[take, k0:k1])),
                scale=torch.from_numpy(np.ascontiguousarray(split.scale[take, g0 : g0 + n_groups])),
                offset=torch.from_numpy(
                    np.ascontiguousarray(split.offset[take, g0 : g0 + n_groups])
                ),
            )
        )

    return load
