"""Sparse mixture-of-experts MLP (Qwen3-MoE): a router picks top-k experts per token.

Experts are stored packed, one tensor per projection, so a grouped kernel can index them
by expert id: ``w13`` [E, 2 * I/tp, H] holds each expert's gate rows then up rows, ``w2``
[E, H, I/tp]. Tensor parallelism splits every expert's intermediate dimension across ranks
(like a ColumnParallel gate_up followed by a RowParallel down) and all-reduces the output.
The router is replicated. CUDA tensors go through the fused Triton kernel, others through
the torch reference below. A quantized checkpoint whose method loads experts
(layers/quantization.py's ExpertQuantMethod: FP8) creates w13 and w2 and their scales; their
loaders below shard every tensor by its own width along the intermediate dimension (scales
in whole blocks). Once loaded (``finish_loading``) a method that computes experts itself
(ExpertKernelQuantMethod: FP8 on CUDA) may keep them quantized, and then runs them in place
of the fused kernel; otherwise they become float weights.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.distributed import TPInfo, all_reduce
from minisgl.layers.activation import ACTIVATIONS
from minisgl.layers.linear import ReplicatedLinear
from minisgl.layers.quantization import ExpertKernelQuantMethod, ExpertQuantMethod
from minisgl.models.config import ModelConfig

# Shard id meaning "the packed tensor of all experts" (transformers 5 fused checkpoints);
# otherwise w13 shards are 2 * expert + (0 gate | 1 up) and w2 shards are the expert id.
ALL_EXPERTS = -1


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in float32, top-k, optional renormalisation (as transformers).

    Returns routing weights [T, K] in the logits' dtype and expert ids [T, K] (int64).
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act: str = "silu",
) -> torch.Tensor:
    """Torch MoE: pairs sorted by expert, one matmul pair per expert that has tokens.

    Same contract as ``minisgl.kernels.moe.fused_moe``. Reading the per-expert counts is a
    host sync, so this path is for CPU and for checking the kernel, not for CUDA graphs.
    """
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    rows = x[order // top_k]  # the token of each sorted pair
    out_sorted = torch.empty(flat.numel(), hidden, dtype=x.dtype, device=x.device)
    act_fn = ACTIVATIONS[act]
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        seg = slice(start, start + n)
        h = act_fn(rows[seg] @ w13[expert].t())
        out_sorted[seg] = h @ w2[expert].t()
        start += n
    out_sorted *= topk_weights.reshape(-1)[order, None].to(x.dtype)
    out = torch.empty_like(out_sorted)
    out[order] = out_sorted  # back to pair order: a deterministic sum over k below
    return out.view(tokens, top_k, hidden).sum(dim=1)


class SparseMoE(nn.Module):
    w13: nn.Parameter
    w2: nn.Parameter

    def __init__(self, cfg: ModelConfig, tp: TPInfo) -> None:
        super().__init__()
        inter = cfg.moe_intermediate_size
        assert inter % tp.size == 0, f"moe_intermediate_size {inter} must divide by TP {tp.size}"
        self.tp = tp
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.act = cfg.hidden_act
        self.local_inter = inter // tp.size
        hidden, e, li = cfg.hidden_size, cfg.num_experts, self.local_inter
        self.gate = ReplicatedLinear(hidden, e)  # router; HF name mlp.gate.weight
        quant = cfg.quant if isinstance(cfg.quant, ExpertQuantMethod) else None
        self.quant = quant
        self.kernel_quant: ExpertKernelQuantMethod | None = None  # set where it kept experts
        for name, shape, load in (
            ("w13", (e, 2 * li, hidden), self.load_w13),
            ("w2", (e, hidden, li), self.load_w2),
        ):
            if quant is not None:
                quant.create_expert_weights(self, name, shape, load)
                continue
            p = nn.Parameter(torch.empty(shape), requires_grad=False)
            p.weight_loader = load  # type: ignore[attr-defined]
            self.register_parameter(name, p)

    def _inter_slice(self, t: torch.Tensor, dim: int, width: int) -> torch.Tensor:
        """This rank's ``width`` of ``t``'s intermediate dimension ``dim``; a tensor only
        ``width`` wide there (one scale per row) is every rank's."""
        if t.shape[dim] == width:
            return t
        return t.narrow(dim, self.tp.rank * width, width)

    def load_w13(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = ALL_EXPERTS
    ) -> None:
        li = param.shape[1] // 2
        if shard_id == ALL_EXPERTS:  # [E, 2I, H]: gate rows then up rows of every expert
            gate, up = loaded.chunk(2, dim=1)
            param.data[:, :li].copy_(self._inter_slice(gate, 1, li))
            param.data[:, li:].copy_(self._inter_slice(up, 1, li))
            return
        expert, which = divmod(shard_id, 2)  # one expert's gate_proj or up_proj [I, H]
        param.data[expert, which * li : (which + 1) * li].copy_(self._inter_slice(loaded, 0, li))

    def load_w2(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = ALL_EXPERTS
    ) -> None:
        width = param.shape[2]  # inputs, or scale blocks of them
        if shard_id == ALL_EXPERTS:  # [E, H, I]
            param.data.copy_(self._inter_slice(loaded, 2, width))
        else:  # one expert's down_proj [H, I]
            param.data[shard_id].copy_(self._inter_slice(loaded, 1, width))

    def finish_loading(self, dtype: torch.dtype) -> None:
        """Called once the checkpoint is loaded (models/loader.py): quantized experts stay
        quantized where their method keeps them (it computes them from then on), else become
        float weights in ``dtype``."""
        quant, self.quant = self.quant, None
        if quant is None:
            return
        # The methods' kernels fuse SiLU-mul only, as kernels/moe.py does.
        if isinstance(quant, ExpertKernelQuantMethod) and self.act == "silu":
            if quant.keep_experts(self, dtype):
                self.kernel_quant = quant
                return
        for name in ("w13", "w2"):
            quant.finish_expert_weights(self, name, dtype)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """``reduce=False``: this rank's partial sum, for the caller to all-reduce."""
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        if self.kernel_quant is not None:
            out = self.kernel_quant.apply_experts(self, x, weights, ids)
        elif x.is_cuda and self.act == "silu":
            # Imported here so CPU-only installs never need triton.
            from minisgl.kernels.moe import fused_moe

            out = fused_moe(x, self.w13, self.w2, weights, ids)
        else:
            out = moe_reference(x, self.w13, self.w2, weights, ids, self.act)
        return all_reduce(out, self.tp) if reduce else out
