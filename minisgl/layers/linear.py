"""Linear layers that shard their weights for tensor parallelism.

Each parameter carries a ``weight_loader`` that copies the rank's slice of a full
checkpoint tensor into it, so loading never materialises the full merged weight. A
quantized checkpoint's method (layers/quantization.py) creates, finishes and multiplies the
weights of the column- and row-parallel layers; the layers only shard.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from minisgl.distributed import TPInfo, all_reduce
from minisgl.distributed.reducer import active_reducer
from minisgl.kernels import GemvTiles
from minisgl.layers.cpu_linear import gemv_add_rms_norm, gemv_silu_mul, linear
from minisgl.layers.quantization import FusingQuantMethod, QuantMethod


def _set_loader(p: nn.Parameter, fn: Callable[..., None]) -> None:
    p.weight_loader = fn  # type: ignore[attr-defined]


class ShardedLinear(nn.Module):
    """What the column- and row-parallel layers share: the weights of a float checkpoint,
    or those ``quant`` makes (None once it has left float weights: the float path runs)."""

    cpu_packed: torch.Tensor | None = None  # see layers/cpu_linear.py
    gemv_tiles: GemvTiles | None = None  # CUDA batch-1 GEMV (set by pack_model)
    weight: nn.Parameter  # float checkpoints, and quantized ones once made float
    fusing_quant: FusingQuantMethod | None = None  # self.quant where it fuses the step before

    def __init__(self, tp: TPInfo, quant: QuantMethod | None) -> None:
        super().__init__()
        self.tp = tp
        self.quant = quant

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        raise NotImplementedError

    def _create_weights(self, out_features: int, in_local: int, in_full: int) -> None:
        if self.quant is not None:
            self.quant.create_weights(self, out_features, in_local, in_full, self.load_shard)
            return
        self.weight = nn.Parameter(torch.empty(out_features, in_local), requires_grad=False)
        _set_loader(self.weight, self.load_shard)

    def finish_loading(self, dtype: torch.dtype) -> None:
        """Called once the checkpoint is loaded (models/loader.py)."""
        if self.quant is not None and not self.quant.finish_loading(self, dtype):
            self.quant = None
        # Checked once: a runtime protocol check costs microseconds per layer and step.
        self.fusing_quant = self.quant if isinstance(self.quant, FusingQuantMethod) else None

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.apply(self, x, bias)
        return linear(x, self.weight, bias, self.cpu_packed, self.gemv_tiles)


class ReplicatedLinear(nn.Module):
    cpu_packed: torch.Tensor | None = None  # see layers/cpu_linear.py
    gemv_tiles: GemvTiles | None = None  # CUDA batch-1 GEMV (set by pack_model)

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.cpu_packed, self.gemv_tiles)


class ColumnParallelLinear(ShardedLinear):
    """Output features split across ranks; shards of several logical outputs may be merged.

    ``output_sizes`` lists the logical (full) outputs packed in this layer, e.g. [gate, up];
    each is split evenly across ranks and the local shards are stored back to back.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        tp: TPInfo,
        quant: QuantMethod | None = None,
    ) -> None:
        super().__init__(tp, quant)
        assert all(s % tp.size == 0 for s in output_sizes), (output_sizes, tp.size)
        self.local_sizes = [s // tp.size for s in output_sizes]
        out = sum(self.local_sizes)
        # A quantized layer's load-time tensors are N-major too: load_shard's narrowing of
        # dim 0 shards and merges them as it does a float weight.
        self._create_weights(out, in_features, in_features)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None
        if self.bias is not None:
            _set_loader(self.bias, self.load_shard)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        size = self.local_sizes[shard_id]
        offset = sum(self.local_sizes[:shard_id])
        part = loaded.narrow(0, self.tp.rank * size, size)
        param.data.narrow(0, offset, size).copy_(part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x, self.bias)

    def forward_add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        in_gemv: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(forward(rmsnorm(x + residual)), x + residual), the norm computed by the kernel
        that makes or reads this layer's input: a quantized method's (FusingQuantMethod),
        or, ``in_gemv`` (unless the engine's disable_fused_norm_gemv), one row's batch-1 GEMV.
        None where neither runs this layer or x is a TP partial sum (its all-reduce comes first)."""
        if self.tp.size > 1:
            return None
        if self.fusing_quant is not None:
            return self.fusing_quant.apply_add_rms_norm(
                self, x, residual, norm_weight, eps, self.bias, in_gemv
            )
        if not in_gemv or self.quant is not None or self.gemv_tiles is None or x.shape[0] != 1:
            return None
        return gemv_add_rms_norm(
            x, residual, norm_weight, eps, self.weight, self.bias, self.gemv_tiles
        )


class QKVParallelLinear(ColumnParallelLinear):
    """Merged q/k/v projection; KV heads are replicated when tp exceeds their number."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TPInfo,
        quant: QuantMethod | None = None,
    ) -> None:
        assert num_heads % tp.size == 0, "attention heads must divide by the TP size"
        if num_kv_heads >= tp.size:
            assert num_kv_heads % tp.size == 0, "KV heads must divide by the TP size"
            self.local_kv_heads = num_kv_heads // tp.size
        else:
            assert tp.size % num_kv_heads == 0, "TP size must be a multiple of the KV heads"
            self.local_kv_heads = 1
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        q = num_heads * head_dim
        kv_local = self.local_kv_heads * head_dim
        super().__init__(hidden, [q, kv_local * tp.size, kv_local * tp.size], bias, tp, quant)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        if shard_id == 0 or self.num_kv_heads >= self.tp.size:
            super().load_shard(param, loaded, shard_id)
            return
        # Replicated KV: rank r uses KV head r * kv_heads // tp.
        head = self.tp.rank * self.num_kv_heads // self.tp.size
        offset = sum(self.local_sizes[:shard_id])
        part = loaded.narrow(0, head * self.head_dim, self.head_dim)
        param.data.narrow(0, offset, self.head_dim).copy_(part)


class RowParallelLinear(ShardedLinear):
    """Input features split across ranks; partial outputs summed with an all-reduce."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPInfo,
        quant: QuantMethod | None = None,
    ) -> None:
        super().__init__(tp, quant)
        assert in_features % tp.size == 0
        self.local_in = in_features // tp.size
        self._create_weights(out_features, self.local_in, in_features)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        # This rank's columns of dim 1 (inputs, or whole groups of them for int4 scales and
        # zeros); a tensor as wide as the parameter (one group spanning all inputs) is shared.
        width = param.shape[1]
        part = loaded if loaded.shape[1] == width else loaded.narrow(1, self.tp.rank * width, width)
        param.data.copy_(part)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """``reduce=False``: this rank's partial sum, for the caller to all-reduce (fused with
        the norm that follows; layers/norm.py); the bias is then added on rank 0 alone."""
        if not reduce and (pushed := self._pushed_partial(x)) is not None:
            return pushed
        return self._finish(self._product(x, None), reduce)

    def forward_silu_mul(
        self, gate_up: torch.Tensor, reduce: bool = True, in_gemv: bool = False
    ) -> torch.Tensor | None:
        """forward(silu(gate) * up) from a gated MLP's [gate | up], the activation computed
        by the kernel that reads x (the same bits): a quantized method's (FusingQuantMethod),
        or, ``in_gemv`` (unless the engine's disable_fused_silu_down), one row's batch-1 GEMV.
        None where neither runs this layer (then the caller runs the two steps)."""
        if self.fusing_quant is not None:
            y = self.fusing_quant.apply_silu_mul(self, gate_up, None, in_gemv)
            return None if y is None else self._finish(y, reduce)
        if not in_gemv or self.quant is not None or self.gemv_tiles is None:
            return None
        if gate_up.shape[0] != 1:
            return None
        if not reduce and self.tp.size > 1 and active_reducer() is not None:
            return None  # the TP reducer's pushing GEMV takes this product
        return self._finish(gemv_silu_mul(gate_up, self.weight, self.gemv_tiles), reduce)

    def _finish(self, y: torch.Tensor, reduce: bool) -> torch.Tensor:
        if reduce or self.tp.size == 1:
            y = all_reduce(y, self.tp)
        elif self.tp.rank != 0:
            return y
        if self.bias is not None:
            y = y + self.bias
        return y

    def _pushed_partial(self, x: torch.Tensor) -> torch.Tensor | None:
        """The batch-1 partial sum, computed by the TP reducer, which also sends it to the
        peers for the fused all-reduce + norm that follows (distributed/reducer.py); None
        where it does not (then the plain product runs)."""
        if self.quant is not None or self.gemv_tiles is None or self.bias is not None:
            return None
        reducer = active_reducer() if self.tp.size > 1 else None
        return None if reducer is None else reducer.pushed_gemv(x, self.weight, self.gemv_tiles)
