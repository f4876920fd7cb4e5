"""Quantized checkpoints: the interface the linear layers call, and the registry of methods.

A checkpoint's config.json names its method in ``quantization_config.quant_method``; the
method registered under that name parses the rest of that dict into a `QuantMethod`
(ValueError naming any setting it does not run), and every linear layer of the model asks
it to:

1. create the layer's load-time parameters (``create_weights``), in place of the float
   ``weight``, each with a ``weight_loader`` that converts a checkpoint tensor and hands it
   to the layer's shard function: tensor-parallel sharding stays the layer's
   (layers/linear.py), whatever the method stores;
2. finish them once the checkpoint is loaded (``finish_loading``), into what the device
   computes with, or into a float ``weight`` (then the layer runs the float path: CPU
   dequantizes once at load);
3. compute the layer's product (``apply``; a down projection's may take the gated MLP's
   [gate | up] and compute the SiLU-and-mul on the way in, a q/k/v or gate/up projection
   the RMSNorm before it, `FusingQuantMethod`).

A method may also load mixture-of-experts weights (`ExpertQuantMethod`, layers/moe.py; a
method without it is refused for MoE models), keep them quantized and compute them
(`ExpertKernelQuantMethod`), and write random weights in its checkpoint's form for
``--load-format dummy`` (`DummyQuantizer`, models/loader.py). A tensor that a layer
needs and the checkpoint lacks fails at ``finish_loading`` with `MissingTensor`, which the
loader names by its checkpoint name.

A float checkpoint has no method. Methods come from extensions, registered when they are
loaded (minisgl/extensions/quantization: 4-bit GPTQ and AWQ, FP8); nothing here imports
torch at run time, since processes that never compute (the API server) load the extensions
too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from minisgl.extension_loader import load_extensions

if TYPE_CHECKING:
    import torch
    from torch import nn


class ShardFn(Protocol):
    """A linear layer's ``load_shard``: copies this rank's part of a full checkpoint tensor
    (``shard_id``: which of the layer's merged outputs, e.g. q, k or v) into ``param``."""

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None: ...


class QuantMethod(Protocol):
    """One checkpoint's quantization (frozen and shared by every layer of the model)."""

    @property
    def name(self) -> str:
        """The checkpoint's ``quant_method``."""
        ...

    def create_weights(
        self, layer: nn.Module, out_features: int, in_local: int, in_full: int, load_shard: ShardFn
    ) -> None:
        """Register ``layer``'s load-time parameters for a product of ``in_local`` inputs
        (this rank's; ``in_full`` over all ranks) into ``out_features`` outputs, each with a
        ``weight_loader`` ending in ``load_shard``. ValueError where the layer's shape does
        not suit the checkpoint's (naming the quantization_config field)."""
        ...

    def finish_loading(self, layer: nn.Module, dtype: torch.dtype) -> bool:
        """After loading, turn the layer's parameters into what its device computes with.
        True: `apply` computes the layer from now on; False: the layer now holds a float
        ``weight`` in ``dtype`` and runs the float path."""
        ...

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, in_local] -> x W^T (+ bias) [M, out_features], in x's dtype."""
        ...


@runtime_checkable
class FusingQuantMethod(QuantMethod, Protocol):
    """A method whose product may compute the step before it (a gated MLP's SiLU-and-mul, a
    decoder layer's RMSNorm) in the kernel that reads or makes its input (FP8: the GEMV,
    the activation quantizer, the norm writing quantized activations), saving a kernel and
    that activation's round trip through memory. Each returns None where it declines."""

    def apply_silu_mul(
        self, layer: nn.Module, gate_up: torch.Tensor, bias: torch.Tensor | None, in_gemv: bool
    ) -> torch.Tensor | None:
        """`apply` of silu(gate) * up (kernels/activation.py's bits) from ``gate_up``
        [M, 2 in_local]. ``in_gemv``: the engine allows the fusion in batch-1 GEMVs (unless
        its ``disable_fused_silu_down``)."""
        ...

    def apply_add_rms_norm(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        bias: torch.Tensor | None,
        in_gemv: bool,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(`apply` of rmsnorm(x + residual) * norm_weight (kernels/norm.py's bits, or in a
        batch-1 GEMV kernels/gemv.py's), x + residual) for x [M, in_local] (x itself as the
        residual without one). ``in_gemv``: the engine allows the fusion in batch-1 GEMVs
        (unless its ``disable_fused_norm_gemv``)."""
        ...


@runtime_checkable
class EmbeddingQuantMethod(QuantMethod, Protocol):
    """A method that also keeps the embedding (and the LM head, `apply`) quantized."""

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (local to the layer) of its weight, in the dtype `finish_loading`
        was given."""
        ...


@runtime_checkable
class ExpertQuantMethod(QuantMethod, Protocol):
    """A method that also loads the packed expert weights of layers/moe.py."""

    def create_expert_weights(
        self, moe: nn.Module, name: str, shape: tuple[int, int, int], load_shard: ShardFn
    ) -> None:
        """Register ``moe``'s load-time parameters of the expert weight ``name`` (this rank's
        [experts, out, in]), the first of them ``name`` itself, each with a ``weight_loader``
        ending in ``load_shard`` (shard ids as layers/moe.py's loaders take them)."""
        ...

    def finish_expert_weights(self, moe: nn.Module, name: str, dtype: torch.dtype) -> None:
        """After loading: ``name`` becomes a float parameter in ``dtype``."""
        ...


@runtime_checkable
class ExpertKernelQuantMethod(ExpertQuantMethod, Protocol):
    """An expert method that may keep the experts quantized and compute them itself (FP8 on
    CUDA). layers/moe.py asks it first, once loaded, and falls back to the float experts of
    ``finish_expert_weights`` where it declines."""

    def keep_experts(self, moe: nn.Module, dtype: torch.dtype) -> bool:
        """After loading: True where ``moe``'s ``w13`` and ``w2`` (both) now hold the form
        `apply_experts` computes with; False, nothing changed, where the device, the layout
        or a switch rules that out."""
        ...

    def apply_experts(
        self, moe: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """kernels/moe.fused_moe's contract on the kept experts (SiLU-gated): x [T, H] ->
        sum_k w_k * expert_k(x) [T, H] in x's dtype; nothing read on the host."""
        ...


@dataclass(frozen=True)
class KernelWeights:
    """A linear layer's packed weight as csrc/cpu_kernels.c reads it: segments of rows of one
    kind, each (codes, scale, offset, fp16 scales, group (0: 4-bit rows), first row, rows),
    the first three as data pointers that stay valid while the layer lives."""

    out_features: int
    in_features: int
    segments: tuple[tuple[int, int, int, int, int, int, int], ...]
    max_rows: int  # the method runs these kernels for products of at most this many rows


@runtime_checkable
class CpuKernelQuantMethod(QuantMethod, Protocol):
    """A method whose packed weights the C kernels read directly (the one-call CPU decode
    stack, models/cpu_stack.py)."""

    def kernel_weights(self, layer: nn.Module) -> KernelWeights | None:
        """``layer``'s weight for the kernels, or None where it is not packed for them."""
        ...


@runtime_checkable
class DummyQuantizer(Protocol):
    """A method that writes random float weights in its checkpoint's form (--load-format dummy)."""

    def quantize(self, name: str, weight: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """A linear weight ``name`` ([out, in]) -> the checkpoint tensors that store it."""
        ...


class MissingTensor(ValueError):
    """``finish_loading``: the checkpoint lacks ``tensor`` (e.g. ``weight_scale_inv``) of shard
    ``shard`` of the layer's parameter ``param``; the message says why it is needed."""

    def __init__(self, param: str, shard: int, tensor: str, why: str) -> None:
        super().__init__(why)
        self.param, self.shard, self.tensor = param, shard, tensor


# A method's parser: ``quantization_config`` -> the method, or ValueError naming the field.
QuantParser = Callable[[Mapping[str, object]], QuantMethod]

_parsers: dict[str, QuantParser] = {}


def register_quant_method(name: str, parse: QuantParser) -> None:
    """``name``: the ``quant_method`` it takes, in lower case."""
    _parsers[name] = parse


def quant_method_names() -> list[str]:
    """Every registered method, extensions loaded first."""
    load_extensions()
    return list(_parsers)


def parse_quant_config(config: Mapping[str, object] | None) -> QuantMethod | None:
    """The method of a Hugging Face ``quantization_config``; None for a float checkpoint.
    Raises ValueError naming the field of any setting this engine does not run."""
    if not config:
        return None
    name = str(config.get("quant_method", "")).lower()
    names = quant_method_names()
    if name not in names:
        raise ValueError(
            f"quantization_config.quant_method={name!r} is not supported (methods: "
            f"{', '.join(names) or 'none: no quantization extension is loaded'})"
        )
    return _parsers[name](config)
