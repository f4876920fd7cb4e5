from __future__ import annotations

import torch
from torch import nn

from minisgl.distributed import TPInfo, all_reduce
from minisgl.distributed.reducer import active_reducer
from minisgl.kernels import cpu


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            # Imported here so CPU-only installs never need triton. Handles [T, H, D] views
            # (q/k norm) in place of a reshape.
            from minisgl.kernels.norm import rms_norm

            return rms_norm(x, self.weight, self.eps)
        # Normalise in float32, like Hugging Face, then cast back before the weight.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None, tp: TPInfo | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual): the fused pre-norm pattern.

        ``tp``: x is this rank's partial sum (a layer's output before its all-reduce), summed
        over the ranks here first; by the TP reducer where it takes these, in the same kernel
        as the norm (distributed/reducer.py)."""
        if tp is not None and tp.size > 1:
            reducer = active_reducer()
            if reducer is not None and reducer.takes_norm(x, residual):
                return reducer.add_rms_norm(x, residual, self.weight, self.eps)
            x = all_reduce(x, tp)
        if x.is_cuda and residual is not None:
            from minisgl.kernels.norm import fused_add_rms_norm

            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if cpu.fused_ok(x) and x.dim() == 2:
            return cpu.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return self.forward(x), x
