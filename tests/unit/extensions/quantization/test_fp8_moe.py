"""The FP8 fused MoE (extensions/quantization/kernels/fp8_moe.py) against float64 products of
the same activations and the dequantized expert weights: block scales (128 x 128), one row
per scale over 128-input blocks (a tensor-parallel shard that cut through blocks), per-row
scales over all inputs (per channel and per tensor); odd expert counts, top_k 2, 1 to 33
tokens. Run under Triton's interpreter on CPU (one child process, see tests/kernel_checks.py)
and natively on CUDA under the ``gpu`` marker; tests/gpu/test_fp8_gpu.py adds Qwen3-30B-A3B's
expert shapes.

Each launch is checked on its own inputs as the kernel quantized them: gate_up against x
through `quantize_groups`, down against the kernel's own SiLU-mul output through it. The
tolerance of a product is test_fp8_kernels.py's GEMM term (2^-10 of the sum of |products|:
e4m3 dots on Hopper tensor cores keep ~14 bits) plus the output dtype's eps per rounding;
SiLU-mul carries the gate's and up's errors through (|silu'| < 1.1).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # the interpreter child: make `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from minisgl.layers.moe import select_experts
from tests import kernel_checks
from tests.kernel_checks import Skip

E4M3 = torch.float8_e4m3fn
Case = tuple[torch.Tensor, ...]


def _fp8_experts(
    e: int, n: int, k: int, sn: int, sk: int, g: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 [E, N, K], float32 scales [E, N/sn, K/sk], the dequantized float64 weights)."""
    q = (torch.randn(e, n, k, generator=g, device=device) * 100).clamp(-448, 448).to(E4M3)
    s = torch.rand(e, n // sn, k // sk, generator=g, device=device) * 1e-3 + 1e-4
    w = q.double() * s.double().repeat_interleave(sn, 1).repeat_interleave(sk, 2)
    return q, s, w


def fp8_moe_case(t: int, e: int, top_k: int, h: int, i: int, sn: int, sk: int | None,
                 dtype: torch.dtype, device: torch.device, seed: int) -> Case:  # fmt: skip
    """(x, w13, w13 scales, w2, w2 scales, routing weights, ids, w13 and w2 in float64);
    ``sk`` None: one scale per row over all inputs (per channel or per tensor)."""
    g = torch.Generator(device=device).manual_seed(seed)
    q13, s13, w13 = _fp8_experts(e, 2 * i, h, sn, sk or h, g, device)
    q2, s2, w2 = _fp8_experts(e, h, i, sn, sk or i, g, device)
    x = (torch.randn(t, h, generator=g, device=device) * 3).to(dtype)
    logits = torch.randn(t, e, generator=g, device=device)
    weights, ids = select_experts(logits, top_k, renormalize=seed % 2 == 0)
    return x, q13, s13, q2, s2, weights.to(dtype), ids, w13, w2


def _dequant_groups(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel multiplies it: quantized per token and 128 inputs, in float64."""
    from minisgl.extensions.quantization.kernels.fp8_gemm import quantize_groups

    q, s = quantize_groups(x)
    return q.double() * s.double().repeat_interleave(128, 1)


def _per_pair(a: torch.Tensor, w: torch.Tensor, expert: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """a [P, K] float64 rows times their experts' w [E, N, K]^T: (products [P, N], the sums
    of |products| [P, N]), one matmul per expert."""
    out = a.new_zeros(a.shape[0], w.shape[1])
    mag = torch.zeros_like(out)
    for ex in range(w.shape[0]):
        rows = (expert == ex).nonzero().flatten()
        out[rows] = a[rows] @ w[ex].T
        mag[rows] = a[rows].abs() @ w[ex].abs().T
    return out, mag


def _assert_within(got: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor, what: str) -> None:
    err = (got.double() - ref).abs()
    bad = err > tol + 1e-6
    assert not bool(bad.any()), (what, int(bad.sum()), (err - tol).max().item())


def assert_fp8_moe(case: Case) -> None:
    from minisgl.extensions.quantization.kernels.fp8_moe import fp8_moe, fp8_moe_stages

    x, q13, s13, q2, s2, weights, ids, w13, w2 = case
    eps, i, top_k = torch.finfo(x.dtype).eps, q2.shape[2], ids.shape[1]
    act, pairs = fp8_moe_stages(x, q13, s13, q2, s2, weights, ids)
    assert act.dtype == pairs.dtype == x.dtype
    expert = ids.reshape(-1)
    # gate_up: each of gate and up off by the GEMM term plus its rounding to x's dtype.
    xd = _dequant_groups(x).repeat_interleave(top_k, 0)  # the token of each pair
    h13, mag13 = _per_pair(xd, w13, expert)
    gate, up = h13[:, :i], h13[:, i:]
    err_g = 2**-10 * mag13[:, :i] + eps * gate.abs()
    err_u = 2**-10 * mag13[:, i:] + eps * up.abs()
    silu = torch.nn.functional.silu(gate)
    ref = silu * up
    tol = (1.1 * err_g + eps * silu.abs()) * (up.abs() + err_u) + silu.abs() * err_u
    _assert_within(act, ref, tol + eps * ref.abs(), "gate_up")
    # down: the kernel's act as it quantized it; output rounded, weighted, rounded again.
    y, mag2 = _per_pair(_dequant_groups(act), w2, expert)
    w = weights.reshape(-1, 1).double()
    ref = y * w
    tol = w.abs() * (2**-10 * mag2 + eps * y.abs()) + eps * ref.abs()
    _assert_within(pairs, ref, tol, "down")
    out = fp8_moe(x, q13, s13, q2, s2, weights, ids)
    assert torch.equal(out, pairs.view(x.shape[0], top_k, -1).sum(1))


def check_fp8_moe_block_scales(device: torch.device) -> None:
    for seed, t in enumerate((1, 5, 33)):
        assert_fp8_moe(fp8_moe_case(t, 5, 2, 256, 128, 128, 128, torch.bfloat16, device, seed))


def check_fp8_moe_row_scales(device: torch.device) -> None:
    """One scale per row: over all inputs (per channel, per tensor), or over 128-input blocks
    (a block-wise shard cut through its blocks); float16 and float32 outputs."""
    for seed, t in enumerate((1, 5, 33)):
        assert_fp8_moe(fp8_moe_case(t, 3, 2, 256, 128, 1, None, torch.float16, device, seed))
    assert_fp8_moe(fp8_moe_case(33, 7, 2, 128, 256, 1, 128, torch.float32, device, 3))
    assert_fp8_moe(fp8_moe_case(5, 3, 2, 384, 128, 1, 128, torch.bfloat16, device, 4))


def check_fp8_moe_edge_cases(device: torch.device) -> None:
    from minisgl.extensions.quantization.kernels.fp8_moe import fp8_moe

    x, q13, s13, q2, s2, weights, ids, w13, w2 = fp8_moe_case(
        9, 5, 2, 128, 128, 128, 128, torch.bfloat16, device, 6
    )
    ids = torch.tensor([[4, 1]] * 9, device=device)  # one long padded run, three empty experts
    assert_fp8_moe((x, q13, s13, q2, s2, weights, ids, w13, w2))
    wide = torch.randn(9, 200, generator=torch.Generator().manual_seed(1)).bfloat16()
    xs = wide[:, :128].to(device)  # rows of a wider buffer
    want = fp8_moe(xs.contiguous(), q13, s13, q2, s2, weights, ids)
    assert torch.equal(fp8_moe(xs, q13, s13, q2, s2, weights, ids), want)
    assert fp8_moe(x[:0], q13, s13, q2, s2, weights[:0], ids[:0]).shape == (0, 128)


def check_fp8_moe_no_host_sync(device: torch.device) -> None:
    """Decode steps are captured in CUDA graphs: no device-to-host reads."""
    if device.type != "cuda":
        raise Skip("host syncs can only be detected on CUDA")
    from minisgl.extensions.quantization.kernels.fp8_moe import fp8_moe

    args = fp8_moe_case(16, 8, 2, 256, 128, 128, 128, torch.bfloat16, device, 7)[:7]
    kernel_checks.assert_no_host_sync(lambda: fp8_moe(*args))


def _build_moe(path: Path, device: torch.device) -> torch.nn.Module:
    """The sparse MoE layer (layer 1) of a checkpoint, loaded on ``device``."""
    from minisgl.distributed import TPInfo
    from minisgl.models.config import ModelConfig
    from minisgl.models.loader import iter_safetensors, load_weights
    from minisgl.models.registry import build_model

    cfg = ModelConfig.from_dir(path)
    with device:
        model = build_model(cfg, TPInfo(), cfg.max_position)
    load_weights(model, iter_safetensors(path, device))
    return model.model.layers[1].mlp


def check_fp8_moe_layer_keeps_e4m3(device: torch.device) -> None:
    """A tiny Qwen3-MoE FP8 checkpoint (block-wise, per channel): the layer keeps its experts
    e4m3 with their scale grids, which dequantize to the float twin's weights exactly, and
    its forward is the FP8 kernel's, checked as above against the twin's weights. On CPU the
    layer is made to keep them (it dequantizes there), to run the kernel interpreted; on CUDA
    MINISGL_FP8_MOE_KERNELS is turned on."""
    import tempfile
    from unittest import mock

    from minisgl import env
    from minisgl.extensions.quantization import FP8_MOE_KERNELS
    from minisgl.extensions.quantization.fp8 import Fp8Method, keep_fp8_experts
    from minisgl.extensions.quantization.kernels.fp8_moe import fp8_moe
    from tests.fp8_checkpoints import write_fp8
    from tests.helpers import make_tiny_model

    def keep(self: Fp8Method, moe: torch.nn.Module, dtype: torch.dtype) -> bool:
        return keep_fp8_experts(moe, self, dtype)

    shape = dict(hidden_size=128, moe_intermediate_size=128, intermediate_size=256,
                 head_dim=64, num_experts=5, num_experts_per_tok=2)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        src = make_tiny_model(Path(tmp) / "src", "qwen3_moe", seed=3, **shape)
        for kind, (sn, sk) in (("block", (128, 128)), ("channel", (1, 128))):
            q, ref = write_fp8(src, Path(tmp) / f"{kind}_q", Path(tmp) / f"{kind}_r", kind,
                               block=(128, 128), seed=len(kind))  # fmt: skip
            cpu = device.type == "cpu"
            patch = mock.patch.object(Fp8Method, "keep_experts", keep)
            with patch if cpu else env.override({FP8_MOE_KERNELS: True}):
                moe = _build_moe(q, device)
            twin = _build_moe(ref, device)
            assert moe.kernel_quant is not None and "w13" not in moe._parameters
            for name in ("w13", "w2"):
                w, s = moe.get_buffer(name), moe.get_buffer(f"{name}_wscale")
                assert w.dtype == E4M3 and s.shape[1:] == (w.shape[1] // sn, w.shape[2] // sk)
                deq = w.float() * s.repeat_interleave(sn, 1).repeat_interleave(sk, 2)
                assert torch.equal(deq, twin.get_parameter(name)), (kind, name)
            x = torch.randn(33, 128, generator=torch.Generator().manual_seed(0)).to(device)
            weights, ids = select_experts(moe.gate(x), 2, renormalize=True)
            ws = (moe.get_buffer(n) for n in ("w13", "w13_wscale", "w2", "w2_wscale"))
            w13, w2 = twin.w13.double(), twin.w2.double()
            assert_fp8_moe((x, *ws, weights, ids, w13, w2))
            ws = (moe.get_buffer(n) for n in ("w13", "w13_wscale", "w2", "w2_wscale"))
            assert torch.equal(moe(x), fp8_moe(x, *ws, weights, ids))  # the layer's path


CHECKS = kernel_checks.collect(globals())

test_interpreted, test_on_gpu = kernel_checks.make_tests(__file__, CHECKS)


if __name__ == "__main__":
    kernel_checks.main(CHECKS)
