"""Fused mixture-of-experts with FP8 experts (W8A8, as SGLang's and vLLM's block-wise fused_moe).

The experts stay e4m3 (``w13`` [E, 2I, H], ``w2`` [E, H, I]) with float32 scales
[E, N/SN, K/SK] (fp8_cuda.pack_fp8's grid: 128 x 128 blocks, or one row per scale). The two
launches of minisgl/kernels/moe.py's grouped GEMM take e4m3 activations: x is quantized once
per token and 128 inputs (`quantize_groups`, as the dense W8A8 GEMM does) before gate_up, and
the SiLU-mul output likewise before down; each K step of 128 inputs scales its float32 dot
by the rows' activation scales and the columns' weight scales. As in the float kernel, no
device value is read on the host: decode steps are captured in CUDA graphs.
"""

from __future__ import annotations

import torch

from minisgl.extensions.quantization.kernels.fp8_gemm import quantize_groups
from minisgl.kernels.moe import ExpertScales, fused_moe, fused_moe_stages


def fp8_moe_stages(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/moe.fused_moe_stages on e4m3 experts: (silu(gate) * up [P, I], the pairs'
    weighted down outputs [P, H]). H and I must be multiples of 128 (the activation groups)."""
    fp8 = ExpertScales(w13_scale, w2_scale, quantize_groups)
    return fused_moe_stages(x, w13, w2, topk_weights, topk_ids, fp8)


def fp8_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """kernels/moe.fused_moe's contract on e4m3 experts and their scales: x [T, H] ->
    sum_k w_k * down_e(silu(gate_e(x)) * up_e(x)) [T, H] in x's dtype."""
    fp8 = ExpertScales(w13_scale, w2_scale, quantize_groups)
    return fused_moe(x, w13, w2, topk_weights, topk_ids, fp8)
