from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        # Imported here so CPU-only installs never need triton.
        from minisgl.kernels.activation import silu_and_mul as fused_silu_and_mul

        return fused_silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


ACTIVATIONS = {"silu": silu_and_mul, "gelu": gelu_and_mul, "gelu_pytorch_tanh": gelu_and_mul}
