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
from minisgl.kernels.moe import GemmScales, launch_moe_gemm, moe_align_block_size, moe_block_m


def fp8_moe_stages(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two products before the sum over top_k: (silu(gate) * up [P, I], the pairs'
    weighted down outputs [P, H]), in x's dtype; P = T * top_k pairs in (token, k) order.
    H and I must be multiples of 128 (the activation groups)."""
    tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    num_pairs = tokens * top_k
    block_m = moe_block_m(num_pairs, num_experts)
    align = moe_align_block_size(topk_ids, num_experts, block_m)
    xq, xs = quantize_groups(x if x.stride(-1) == 1 else x.contiguous())
    act = torch.empty(num_pairs, two_i // 2, dtype=x.dtype, device=x.device)
    scales = GemmScales(xs, w13_scale)
    launch_moe_gemm(xq, w13, act, None, align, block_m, top_k, fuse_silu=True, scales=scales)
    aq, a_s = quantize_groups(act)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).to(x.dtype)
    scales = GemmScales(a_s, w2_scale)
    launch_moe_gemm(aq, w2, out, weights, align, block_m, 1, fuse_silu=False, scales=scales)
    return act, out


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
    tokens, hidden = x.shape
    if tokens == 0:
        return torch.zeros_like(x)
    _, out = fp8_moe_stages(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids)
    return out.view(tokens, topk_ids.shape[1], hidden).sum(dim=1)
