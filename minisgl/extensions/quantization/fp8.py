"""FP8 checkpoints, dense layers and MoE experts: e4m3 on CUDA, else dequantized at load.

Formats (Hugging Face ``quantization_config``), for a linear y = x W^T with W [N, K] and a
``weight`` in e4m3 (float8_e4m3fn):

* ``quant_method: fp8`` (transformers' fine-grained FP8: Qwen3-FP8, DeepSeek-V3):
  ``weight_block_size: [bn, bk]`` and ``weight_scale_inv`` [N/bn, K/bk]; despite the name,
  W = weight * weight_scale_inv of its block. Without ``weight_block_size``, one scale per
  tensor. ``activation_scheme``: dynamic, or static with an ``input_scale`` per layer.
* compressed-tensors, ``format: float-quantized``: ``weight_scale`` [N, 1] (weights'
  ``strategy: channel``) or [1] (``tensor``), W = weight * weight_scale; input activations
  dynamic (per token), or static (``input_scale`` tensors).

A layer is FP8 when its weight is e4m3, and then needs its scale; a layer the checkpoint keeps
in float (``modules_to_not_convert``, ``ignore``) loads as in a float checkpoint. Loading
keeps every tensor N-major at full row resolution, the weight's values in the compute dtype
(exact: every e4m3 value is a bf16, fp16 and fp32 value) and each block's scale repeated
over its rows, so the layers' own sharding (merged q/k/v and gate/up, column- and
row-parallel TP, expert slices) applies unchanged; row-parallel ranks and the experts'
down projections split K along whole scale blocks. ``finish_loading`` then turns a dense
layer on CUDA into e4m3 weights and float32 scales for the FP8 kernels (fp8_cuda.py; unless
MINISGL_FP8_KERNELS=0): half the bytes of bf16; ``keep_experts`` does the same for a MoE
layer's experts (kernels/fp8_moe.py). Elsewhere (CPU, layouts the kernels do not take) it
multiplies the scales in (float32 products, rounded once to the compute dtype) and the
layer runs the float path. Static input scales must be in the file
but are not used: the kernels quantize activations dynamically (or not at all, 1-4 rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from minisgl.extensions.quantization.fp8_cuda import (
    fp8_experts_forward,
    fp8_forward,
    fp8_norm_forward,
    fp8_silu_forward,
    pack_fp8,
    set_fp8_buffers,
)
from minisgl.extensions.quantization.int4 import register_raw
from minisgl.extensions.quantization.switches import FP8_KERNELS, FP8_MOE_KERNELS
from minisgl.layers.quantization import MissingTensor, ShardFn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


@dataclass(frozen=True)
class Fp8Method:
    """FP8 weights (a layers/quantization.py QuantMethod, ExpertKernelQuantMethod,
    DummyQuantizer)."""

    name: str  # the checkpoint's quant_method: "fp8" or "compressed-tensors"
    scale_name: str  # "weight_scale_inv" (fp8) or "weight_scale" (compressed-tensors)
    block: tuple[int, int] | None = None  # (rows, inputs) per scale; None: per channel/tensor
    per_channel: bool = False  # without block: one scale per output row, else per tensor
    static_field: str = ""  # the config field asking for static input scales ("": dynamic)

    def create_weights(
        self, layer: nn.Module, out_features: int, in_local: int, in_full: int, load_shard: ShardFn
    ) -> None:
        add_fp8_params(layer, "weight", (out_features, in_local), self, load_shard)

    def finish_loading(self, layer: nn.Module, dtype: torch.dtype) -> bool:
        return finish_fp8(layer, "weight", self, dtype, kernels=FP8_KERNELS.get())

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_forward(layer, x, bias)

    def apply_silu_mul(
        self, layer: nn.Module, gate_up: torch.Tensor, bias: torch.Tensor | None, in_gemv: bool
    ) -> torch.Tensor | None:
        return fp8_silu_forward(layer, gate_up, bias, in_gemv)

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
        return fp8_norm_forward(layer, x, residual, norm_weight, eps, bias, in_gemv)

    def create_expert_weights(
        self, moe: nn.Module, name: str, shape: tuple[int, int, int], load_shard: ShardFn
    ) -> None:
        add_fp8_params(moe, name, shape, self, load_shard)

    def finish_expert_weights(self, moe: nn.Module, name: str, dtype: torch.dtype) -> None:
        finish_fp8(moe, name, self, dtype)

    def keep_experts(self, moe: nn.Module, dtype: torch.dtype) -> bool:
        """CUDA, MINISGL_FP8_KERNELS and MINISGL_FP8_MOE_KERNELS on: e4m3 experts for
        kernels/fp8_moe.py."""
        on = FP8_KERNELS.get() and FP8_MOE_KERNELS.get()
        if not on or not moe.get_parameter("w13").is_cuda:
            return False
        return keep_fp8_experts(moe, self, dtype)

    def apply_experts(
        self, moe: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return fp8_experts_forward(moe, x, topk_weights, topk_ids)

    def quantize(self, name: str, weight: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Max-abs scaling per block, row or tensor (--load-format dummy)."""
        w = weight.float()
        n, k = w.shape
        if self.block is not None:
            bn, bk = self.block
            try:
                check_blocks(self, (n, k), k)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
            amax = w.unflatten(1, (k // bk, bk)).unflatten(0, (n // bn, bn)).abs().amax((1, 3))
        else:
            amax = w.abs().amax(1, keepdim=True) if self.per_channel else w.abs().amax().view(1)
        scale = amax.clamp_min(1e-12) / E4M3_MAX
        q = (w / _per_element(scale, self.block)).to(E4M3)
        out = [(name, q), (name.removesuffix("weight") + self.scale_name, scale)]
        if self.static_field:
            out.append((name.removesuffix("weight") + "input_scale", torch.ones(1)))
        return out


def _per_element(scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """Scales [N/bn, K/bk], [N, 1] or [1] -> a tensor that broadcasts over the weight."""
    if block is None:
        return scale
    return scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)


# ------------------------------------------------------------------ the layer's parameters
def _names(weight: str, method: Fp8Method) -> tuple[str, str, str]:
    """The load-time parameters beside ``weight``: the e4m3 rows' shard ids, the scales and
    the input scales (checkpoint suffixes; an expert weight's are prefixed with its name)."""
    prefix = "" if weight == "weight" else f"{weight}_"
    return prefix + "fp8_shard", prefix + method.scale_name, prefix + "input_scale"


def check_blocks(method: Fp8Method, shape: tuple[int, ...], in_local: int) -> None:
    if method.block is None:
        return
    bn, bk = method.block
    n, k = shape[-2:]
    if n % bn or k % bk or in_local % bk:
        raise ValueError(
            f"quantization_config.weight_block_size=[{bn}, {bk}] does not split its shape "
            f"{tuple(shape)} ({in_local} inputs per tensor-parallel rank) into whole blocks"
        )


def add_fp8_params(
    module: nn.Module, weight: str, shape: tuple[int, ...], method: Fp8Method, load_shard: ShardFn
) -> None:
    """Register ``weight`` (``shape`` [..., N, K_local], the compute dtype) and its scales
    (float32) on ``module``; ``fp8_shard`` [..., N, 1] holds each e4m3 row's shard id (-1: a
    float row), so finish_fp8 knows which rows need a scale and which per-tensor one."""
    shard_name, scale_name, input_name = _names(weight, method)
    *lead, n, k = shape
    full = torch.full
    rows = nn.Parameter(full((*lead, n, 1), -1, dtype=torch.int32), requires_grad=False)
    table = (math.prod(lead) * n,)  # per-tensor values, indexed by shard id (< rows)
    if method.block is not None:
        scale_shape: tuple[int, ...] = (*lead, n, k // method.block[1])
    else:
        scale_shape = (*lead, n, 1) if method.per_channel else table
    scales = nn.Parameter(full(scale_shape, math.nan), requires_grad=False)
    w = nn.Parameter(torch.empty(shape), requires_grad=False)

    def load_weight(param: nn.Parameter, t: torch.Tensor, shard: int = 0) -> None:
        if t.dtype == E4M3:
            if shard < 0:
                raise ValueError("float8 experts load from one tensor per expert, not packed")
            check_blocks(method, tuple(t.shape), shape[-1])
            load_shard(rows, full((*t.shape[:-1], 1), shard, dtype=torch.int32), shard)
        elif not t.is_floating_point() or t.dtype.itemsize < 2:
            raise ValueError(
                f"{t.dtype} weights are not supported (quantization_config.quant_method="
                f"{method.name!r} runs float8_e4m3fn weights, fmt 'e4m3', and float ones)"
            )
        load_shard(param, t.to(param.dtype), shard)

    def load_scale(param: nn.Parameter, t: torch.Tensor, shard: int = 0) -> None:
        if param.dim() == 1:
            _load_per_tensor(param, t, shard)
            return
        t = t.float().reshape(-1, 1) if t.dim() == 1 else t.float()
        if method.block is not None:
            t = t.repeat_interleave(method.block[0], dim=-2)
        try:
            load_shard(param, t, shard)
        except RuntimeError as e:  # a shape that is not this format's
            raise ValueError(f"{scale_name} does not fit {method.name!r} scales: {e}") from None

    register_raw(module, weight, w, load_weight)
    register_raw(module, shard_name, rows, None)
    register_raw(module, scale_name, scales, load_scale, optional=True)
    if method.static_field:
        inputs = nn.Parameter(full(table, math.nan), requires_grad=False)
        register_raw(module, input_name, inputs, _load_per_tensor, optional=True)


def _load_per_tensor(param: nn.Parameter, t: torch.Tensor, shard: int = 0) -> None:
    if t.numel() != 1 or shard < 0:
        raise ValueError(f"one value per tensor expected, got shape {tuple(t.shape)}")
    param.data[shard] = t.float().reshape(())


def _fp8_rows(
    module: nn.Module, weight: str, method: Fp8Method, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight``'s loaded rows in ``dtype`` [..., N, K], which rows are e4m3 [..., N] and
    their scales [..., N, K/bk or 1]. MissingTensor for e4m3 rows without their scale (or
    static input scale)."""
    shard_name, scale_name, input_name = _names(weight, method)
    w = module.get_parameter(weight).data.to(dtype)
    shard = module.get_parameter(shard_name).data[..., 0]  # [..., N]
    fp8 = shard >= 0
    scales = module.get_parameter(scale_name).data
    if scales.dim() == 1:  # per tensor: each row reads its shard's value
        scales = scales[shard.clamp(min=0)].unsqueeze(-1)
    # (the checkpoint's tensor, its values per row, the config field that asks for it)
    needs = [(method.scale_name, scales, f"quantization_config.quant_method={method.name!r}")]
    if method.static_field:
        inputs = module.get_parameter(input_name).data[shard.clamp(min=0)].unsqueeze(-1)
        needs.append(("input_scale", inputs, method.static_field))
    for name, values, field in needs:
        missing = fp8 & values.isnan().any(-1)
        if bool(missing.any()):
            why = f"{field} needs it beside a float8_e4m3fn weight"
            raise MissingTensor(weight, int(shard[missing][0]), name, why)
    return w, fp8, scales


def _drop_load_params(module: nn.Module, weight: str, method: Fp8Method) -> None:
    for name in (weight, *_names(weight, method)):
        if name in module._parameters:
            delattr(module, name)


def finish_fp8(
    module: nn.Module, weight: str, method: Fp8Method, dtype: torch.dtype, kernels: bool = False
) -> bool:
    """Multiply every e4m3 row by its scales; ``weight`` becomes a float parameter in
    ``dtype`` (False). ``kernels``: a CUDA tensor of e4m3 rows only becomes the FP8 kernels'
    buffers instead where they take its layout (True). MissingTensor for e4m3 rows without
    their scale (or static input scale)."""
    w, fp8, scales = _fp8_rows(module, weight, method, dtype)
    packed = None
    if kernels and w.is_cuda and w.dim() == 2 and bool(fp8.all()):
        packed = pack_fp8(w, scales, method.block)
    if packed is None and bool(fp8.any()):
        scales = torch.where(fp8.unsqueeze(-1), scales, 1.0)
        # In place, computed in float32 (the scales' dtype) and rounded once to ``dtype``.
        w.unflatten(-1, (scales.shape[-1], -1)).mul_(scales.unsqueeze(-1))
    _drop_load_params(module, weight, method)
    if packed is not None:
        set_fp8_buffers(module, *packed)
        return True
    module.register_parameter(weight, nn.Parameter(w, requires_grad=False))
    return False


def keep_fp8_experts(moe: nn.Module, method: Fp8Method, dtype: torch.dtype) -> bool:
    """``moe``'s w13 and w2 become e4m3 buffers and their scale grids (fp8_cuda.pack_fp8:
    ``w13``, ``w13_wscale``, ``w2``, ``w2_wscale``) where every row of both is e4m3 and the
    FP8 MoE kernel takes both layouts (True); else nothing changes (False). On every device:
    the caller decides where the kernel runs (tests run it under Triton's interpreter)."""
    packed = {}
    for name in ("w13", "w2"):
        w, fp8, scales = _fp8_rows(moe, name, method, dtype)
        kept = pack_fp8(w, scales, method.block) if bool(fp8.all()) else None
        if kept is None:
            return False
        packed[name] = kept
    for name, (qweight, wscale) in packed.items():
        _drop_load_params(moe, name, method)
        set_fp8_buffers(moe, qweight, wscale, name)
    return True
