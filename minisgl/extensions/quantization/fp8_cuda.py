"""FP8 layers on CUDA: the e4m3 weights stay e4m3 and the FP8 kernels multiply them.

`pack_fp8` turns a layer's loaded rows (fp8.py's load-time form: e4m3 values in the compute
dtype, scales repeated over each block's rows) into the kernels' form: ``qweight`` e4m3
[N, K] and ``wscale`` float32 [N/SN, K/SK], one scale per SN rows x SK inputs (128 x 128 for
block-wise checkpoints whose blocks survived tensor-parallel sharding whole, else one row
per scale: SN = 1; per-channel and per-tensor: SN = 1, SK = K); a MoE layer's experts the
same with the expert leading. `fp8_forward` runs 1-4 rows on kernels/fp8_gemv.py
(weight-only, MINISGL_FP8_GEMV; the widest weights excepted) and more on
kernels/fp8_gemm.py (W8A8, activations quantized per token and 128 inputs; a down
projection's quantizer computes the SiLU-and-mul before it, `fp8_silu_forward`, and the
RMSNorm before the q/k/v and gate/up projections quantizes its output, `fp8_norm_forward`);
`fp8_experts_forward` runs the experts on kernels/fp8_moe.py (W8A8). Nothing here imports triton: CPU processes never reach the
kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.extensions.quantization.switches import FP8_CUBLAS, FP8_FUSED_ACT, FP8_GEMV

E4M3 = torch.float8_e4m3fn
GROUP = 128  # kernels/fp8_gemm.py's activation group (K steps of whole groups)
GEMV_MAX_ROWS = 4  # kernels/fp8_gemv.py's MAX_ROWS
# 2-4 rows of the widest weights (Qwen3-8B's gate_up, 100M e4m3 values) run the W8A8 GEMM on
# 64-row tiles (e4m3 wgmma fed by cp.async, no per-weight conversion) rather than the GEMV's
# 3-D tiles, whose e4m3 -> float32 conversions bound them (H200, cold, 1 row, 30.8 vs 38.6
# us, 2026-12-06). One row runs the GEMV everywhere: its FLAT tiles beat the GEMM's on
# gate_up too (H100, cold, 34.1 vs 38.2 us, benchmark/RESULTS.md 2026-12-07).
GEMV_MAX_WEIGHTS = 64 * 2**20
WIDE_FEW_ROWS_TILES = (64, 64, 4, 3)  # fp8_gemm's (BLOCK_M, BLOCK_N, warps, stages)
CUBLAS_MIN_ROWS = 5  # UNMEASURED: rows from which cuBLASLt's block-scaled GEMM runs
_cublas_runs: dict[torch.device, bool] = {}  # per device, probed once at load


def cublas_block_gemm_runs(device: torch.device) -> bool:
    """Whether torch's scaled_mm runs 1x128 x 128x128 block scaling on ``device`` (cuBLASLt
    of CUDA >= 12.9, Hopper) and agrees with kernels/fp8_gemm.py: probed once, at load time
    (never inside a CUDA-graph capture)."""
    if device.type != "cuda":
        return False
    if device not in _cublas_runs:
        _cublas_runs[device] = _probe_cublas(device)
    return FP8_CUBLAS.get() and _cublas_runs[device]


def _probe_cublas(device: torch.device) -> bool:
    from minisgl.extensions.quantization.kernels import fp8_gemm

    g = torch.Generator(device=device).manual_seed(0)
    for m, n, k in ((40, 256, 512), (37, 384, 1024)):  # 37: the pad rows of cublas_rows
        x = torch.randn(m, k, device=device, generator=g).bfloat16()
        w = torch.randn(n, k, device=device, generator=g).to(E4M3)
        s = torch.rand(n // GROUP, k // GROUP, device=device, generator=g) + 0.5
        try:
            got = fp8_gemm.cublas_fp8_gemm(x, w, s).float()
        except Exception:  # noqa: BLE001 - any failure (recipe, layout, signature): not this route
            return False
        want = fp8_gemm.fp8_gemm(x, w, s).float()
        if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item()):
            return False
    return True


def pack_fp8(
    w: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``w`` [..., N, K] (e4m3 values in a float dtype; experts lead) and ``scales``
    [..., N, K/bk] (block) or [..., N, 1] -> (qweight, wscale [..., N/SN, K/SK]); None where
    the kernels do not run the layout (then the caller dequantizes): K or a block's inputs
    not in whole activation groups."""
    n, k = w.shape[-2:]
    sk = block[1] if block is not None else k
    if k % GROUP or sk % GROUP:
        return None
    sn = block[0] if block is not None and n % block[0] == 0 else 1
    grid = scales.float().unflatten(-2, (n // sn, sn))
    if sn > 1 and not bool((grid == grid[..., :1, :]).all()):
        sn = 1  # a TP shard cut through blocks: rows of one block hold different scales
    wscale = scales.float()[..., ::sn, :].contiguous()
    return w.to(E4M3).contiguous(), wscale


def set_fp8_buffers(
    layer: nn.Module, qweight: torch.Tensor, wscale: torch.Tensor, name: str = ""
) -> None:
    """A dense layer's ``qweight`` and ``wscale``; experts' ``<name>`` and ``<name>_wscale``."""
    # Buffers, not parameters: nothing loads into them, and pack_model skips them.
    if not name and qweight.is_cuda:
        cublas_block_gemm_runs(qweight.device)  # probed now: forward may run in a capture
    layer.register_buffer(name or "qweight", qweight, persistent=False)
    layer.register_buffer(f"{name}_wscale" if name else "wscale", wscale, persistent=False)


def use_fp8_gemv(rows: int, enabled: bool | None = None) -> bool:
    """Whether ``rows`` rows run the weight-only GEMV rather than the W8A8 GEMM."""
    on = FP8_GEMV.get() if enabled is None else enabled
    return on and 0 < rows <= GEMV_MAX_ROWS


def _buffers(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    # The module's own dict: nn.Module attribute lookup costs microseconds per layer and step.
    qweight, wscale = layer._buffers["qweight"], layer._buffers["wscale"]
    assert qweight is not None and wscale is not None
    return qweight, wscale


def _route(qweight: torch.Tensor, wscale: torch.Tensor, rows: int, device: torch.device) -> str:
    """Which kernel multiplies ``rows`` rows: "gemv" (weight-only), "cublas" (cuBLASLt's
    block-scaled GEMM) or "gemm" (kernels/fp8_gemm.py), the last two W8A8."""
    if use_fp8_gemv(rows) and (rows == 1 or qweight.numel() < GEMV_MAX_WEIGHTS):
        return "gemv"
    # K/128 a multiple of 4: torch's newer scaled_mm asks the weight scales' rows padded so
    # (its meta checks' L4), the older entry point took K/128 = 2, and session 19's probe of
    # that shape disagreed with the Triton GEMM.
    k_groups = wscale.shape[1]
    blocks = wscale.shape[0] * GROUP == qweight.shape[0] and k_groups * GROUP == qweight.shape[1]
    # Any row count: the activations are quantized with rows padded to a multiple of 4
    # (kernels/fp8_gemm.cublas_rows), as cuBLASLt asks.
    if blocks and k_groups % 4 == 0 and rows >= CUBLAS_MIN_ROWS and cublas_block_gemm_runs(device):
        return "cublas"
    return "gemm"


def _few_rows_tiles(rows: int) -> tuple[int, int, int, int] | None:
    """The Triton GEMM's tiles: its 64-row ones for the GEMV's rows it takes, else its own."""
    return WIDE_FEW_ROWS_TILES if use_fp8_gemv(rows) else None


def fp8_forward(
    layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, silu_x: bool = False
) -> torch.Tensor:
    """x W^T (+ bias) on the buffers of `set_fp8_buffers`. ``silu_x``: x is a gated MLP's
    [gate | up] and the product is silu(gate) * up's, computed by the kernel that reads x
    (the GEMV, or the GEMM's activation quantizer; kernels/activation.py's bits)."""
    qweight, wscale = _buffers(layer)
    route = _route(qweight, wscale, x.shape[0], x.device)
    return _product(qweight, wscale, x, bias, route, silu_x)


def _product(
    qweight: torch.Tensor,
    wscale: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    route: str,
    silu_x: bool,
) -> torch.Tensor:
    """The product on ``route`` (`_route`)."""
    if route == "gemv":
        from minisgl.extensions.quantization.kernels import fp8_gemv

        return fp8_gemv.fp8_gemv(x, qweight, wscale, bias, silu_x=silu_x)
    from minisgl.extensions.quantization.kernels import fp8_gemm

    if route == "cublas":
        return fp8_gemm.cublas_fp8_gemm(x, qweight, wscale, bias, silu_x=silu_x)
    tiles = _few_rows_tiles(x.shape[0])
    return fp8_gemm.fp8_gemm(x, qweight, wscale, bias, tiles, silu_x=silu_x)


def fp8_silu_forward(
    layer: nn.Module, gate_up: torch.Tensor, bias: torch.Tensor | None, in_gemv: bool
) -> torch.Tensor | None:
    """`fp8_forward` of silu(gate) * up from a gated MLP's [gate | up], or None where the
    caller should run SiLU-and-mul's own kernel first: in the GEMV's rows unless ``in_gemv``
    (unless the engine's disable_fused_silu_down), elsewhere unless MINISGL_FP8_FUSED_ACT."""
    qweight, wscale = _buffers(layer)
    route = _route(qweight, wscale, gate_up.shape[0], gate_up.device)
    if not (in_gemv if route == "gemv" else FP8_FUSED_ACT.get()):
        return None
    return _product(qweight, wscale, gate_up, bias, route, silu_x=True)


def fp8_norm_forward(
    layer: nn.Module,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    bias: torch.Tensor | None,
    in_gemv: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(`fp8_forward` of rmsnorm(x + residual), x + residual): in the GEMV's one row with the
    norm in its prologue where ``in_gemv`` (unless the engine's disable_fused_norm_gemv); in
    the GEMM's with the activations quantized by the norm's kernel
    (kernels/norm.add_rms_norm_quant: the same bits as the norm, then the quantizer) unless
    MINISGL_FP8_FUSED_ACT is off. None where the caller should run the norm first, or the
    inputs' dtype is not the norm weight's."""
    qweight, wscale = _buffers(layer)
    route = _route(qweight, wscale, x.shape[0], x.device)
    if x.dtype != norm_weight.dtype:
        return None
    if route == "gemv":
        if not in_gemv or x.shape[0] != 1:  # batch 1, as the bf16 GEMV's norm prologue
            return None
        from minisgl.extensions.quantization.kernels import fp8_gemv

        return fp8_gemv.fp8_gemv_add_rms_norm(x, residual, norm_weight, eps, qweight, wscale, bias)
    if not FP8_FUSED_ACT.get():
        return None
    from minisgl.extensions.quantization.kernels import fp8_gemm
    from minisgl.kernels.norm import add_rms_norm_quant

    cublas = route == "cublas"
    q, qs, res = add_rms_norm_quant(x, residual, norm_weight, eps, column_major=cublas)
    if cublas:
        return fp8_gemm.cublas_quantized_gemm(q, qs, qweight, wscale, bias, x.dtype, len(x)), res
    tiles = _few_rows_tiles(x.shape[0])
    return fp8_gemm.quantized_gemm(q, qs, qweight, wscale, bias, x.dtype, tiles), res


def fp8_experts_forward(
    moe: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The fused MoE (kernels/fp8_moe.py) on the experts of fp8.keep_fp8_experts."""
    from minisgl.extensions.quantization.kernels.fp8_moe import fp8_moe

    b = moe._buffers
    w13, w13_scale, w2, w2_scale = (b[n] for n in ("w13", "w13_wscale", "w2", "w2_wscale"))
    assert w13 is not None and w13_scale is not None and w2 is not None and w2_scale is not None
    return fp8_moe(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids)
