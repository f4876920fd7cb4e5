"""The linear layers' hooks for a quantized method that computes the step before its product
(layers/quantization.FusingQuantMethod: FP8 fuses the SiLU-and-mul and the RMSNorm into the
kernels around its GEMMs): the layers hand the method the unfused step's input, with the
bias and the TP reduction where they belong, and fall back to the two steps where it
declines. A float method stands in for FP8 (whose kernels need CUDA); the reference is the
unfused float computation."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from minisgl.distributed import TPInfo
from minisgl.layers.activation import silu_and_mul
from minisgl.layers.linear import ColumnParallelLinear, RowParallelLinear
from minisgl.layers.norm import RMSNorm
from minisgl.layers.quantization import FusingQuantMethod, ShardFn
from minisgl.models.config import ModelConfig, RopeConfig
from minisgl.models.decoder_layer import GatedMLP


@dataclass
class FloatFusing:
    """Float weights; records each fused call, declines while ``decline``."""

    name: str = "float-fusing"
    decline: bool = False
    calls: list[str] = field(default_factory=list)

    def create_weights(self, layer: nn.Module, out_features: int, in_local: int, in_full: int,
                       load_shard: ShardFn) -> None:  # fmt: skip
        layer.weight = nn.Parameter(torch.randn(out_features, in_local), requires_grad=False)

    def finish_loading(self, layer: nn.Module, dtype: torch.dtype) -> bool:
        return True

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return nn.functional.linear(x, layer.get_parameter("weight"), bias)

    def apply_silu_mul(self, layer: nn.Module, gate_up: torch.Tensor,
                       bias: torch.Tensor | None, in_gemv: bool) -> torch.Tensor | None:  # fmt: skip
        self.calls.append(f"silu in_gemv={in_gemv}")
        return None if self.decline else self.apply(layer, silu_and_mul(gate_up), bias)

    def apply_add_rms_norm(self, layer: nn.Module, x: torch.Tensor,
                           residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                           bias: torch.Tensor | None,
                           in_gemv: bool) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        self.calls.append(f"norm residual={residual is not None} in_gemv={in_gemv}")
        if self.decline:
            return None
        norm = RMSNorm(x.shape[1], eps)
        norm.weight.data.copy_(norm_weight)
        h, res = norm.forward_with_residual(x, residual)
        return self.apply(layer, h, bias), res


def test_float_fusing_is_a_fusing_method() -> None:
    assert isinstance(FloatFusing(), FusingQuantMethod)


def test_column_layer_hands_its_norm_to_the_method() -> None:
    torch.manual_seed(0)
    method = FloatFusing()
    proj = ColumnParallelLinear(64, [32, 32], True, TPInfo(), method)
    proj.bias.data.normal_()  # type: ignore[union-attr]
    proj.finish_loading(torch.float32)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data.uniform_(0.5, 1.5)
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    for res, in_gemv in ((residual, True), (None, False)):
        got = proj.forward_add_rms_norm(x, res, norm.weight, norm.eps, in_gemv)
        h, want_res = norm.forward_with_residual(x, res)
        assert got is not None
        torch.testing.assert_close(got[0], proj(h))
        torch.testing.assert_close(got[1], want_res)
    assert method.calls == ["norm residual=True in_gemv=True", "norm residual=False in_gemv=False"]
    method.decline = True
    assert proj.forward_add_rms_norm(x, residual, norm.weight, norm.eps) is None
    tp2 = ColumnParallelLinear(64, [32, 32], False, TPInfo(0, 2), FloatFusing())
    tp2.finish_loading(torch.float32)  # x would be a partial sum: the all-reduce comes first
    assert tp2.forward_add_rms_norm(x, residual, norm.weight, norm.eps) is None


def test_gated_mlp_hands_its_silu_to_the_down_projection() -> None:
    """GatedMLP.forward_gate_up passes the engine's SiLU-in-down fusion along; the bias joins
    once, after the product; a declining method leaves the two steps."""
    torch.manual_seed(1)
    method = FloatFusing()
    cfg = ModelConfig("Qwen3ForCausalLM", "qwen3", 100, 64, 96, 1, 4, 4, 16, 1e-6, 128,
                      RopeConfig(), mlp_bias=True, quant=method)  # fmt: skip
    mlp = GatedMLP(cfg, 96, TPInfo())
    assert isinstance(mlp.down_proj, RowParallelLinear)
    mlp.down_proj.bias.data.normal_()  # type: ignore[union-attr]
    mlp.down_proj.finish_loading(torch.float32)
    gate_up = torch.randn(3, 192)
    want = nn.functional.linear(silu_and_mul(gate_up), mlp.down_proj.weight, mlp.down_proj.bias)
    for in_gemv in (False, True):
        mlp.silu_in_down = in_gemv
        torch.testing.assert_close(mlp.forward_gate_up(gate_up), want)
    method.decline = True
    torch.testing.assert_close(mlp.forward_gate_up(gate_up), want)
    assert method.calls == ["silu in_gemv=False", "silu in_gemv=True", "silu in_gemv=True"]
