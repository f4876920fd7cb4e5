"""The fused Triton MoE (kernels/moe.py) against the torch reference: block alignment of the
routed pairs, the fused experts in f32/bf16/f16, edge cases, and no host sync on CUDA.

Kernel checks need TRITON_INTERPRET=1 before triton's first import, so they run in one
child process (this file run as a script prints a JSON verdict per check), as in
test_fused_ops.py. tests/gpu/test_moe_gpu.py runs the same checks on CUDA.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":  # the interpreter child: make `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from minisgl.layers.moe import moe_reference, select_experts
from tests import kernel_checks  # noqa: E402
from tests.kernel_checks import Skip  # noqa: E402

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# Half precision: a few ulps of the output scale (the interpreter also truncates bf16 casts).
TOL = {F32: (1e-5, 1e-5), F16: (4e-3, 4e-3), BF16: (4e-2, 4e-2)}


def moe_case(
    t: int, e: int, k: int, h: int, i: int, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, ...]:
    """x [t, h], w13 [e, 2i, h], w2 [e, h, i], routing weights and ids [t, k]; unit-scale out."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    weights, ids = select_experts(torch.randn(t, e, generator=g), k, renormalize=seed % 2 == 0)
    x, w13, w2, weights = (z.to(dtype).to(device) for z in (x, w13, w2, weights))
    return x, w13, w2, weights, ids.to(device)


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=atol, rtol=rtol)


# ---- kernel checks: each takes the device and raises on mismatch ----


def check_align_block_size(device: torch.device) -> None:
    from minisgl.kernels.moe_align import max_padded_pairs, moe_align_block_size

    g = torch.Generator().manual_seed(0)
    # The last three: many chunks of pairs (30B-A3B's 128 experts; 60, not a power of 2) and
    # top-1 ids, whose flat view is strided.
    cases = [(7, 8, 2, 16), (50, 4, 2, 64), (1, 64, 8, 16), (0, 8, 2, 16)]
    cases += [(300, 128, 8, 16), (257, 60, 4, 32), (129, 3, 1, 16)]
    for t, e, k, bm in cases:
        ids = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k]  # k distinct experts
        sorted_pairs, block_expert, num_padded = moe_align_block_size(ids.to(device), e, bm)
        sorted_pairs, block_expert = sorted_pairs.cpu().long(), block_expert.cpu().long()
        pairs, flat = t * k, ids.reshape(-1)
        counts = torch.bincount(flat, minlength=e)
        n = int(num_padded.item())
        assert n == int(((counts + bm - 1) // bm * bm).sum())
        assert sorted_pairs.numel() == max_padded_pairs(pairs, e, bm) >= n
        assert (sorted_pairs[n:] == pairs).all(), "slots past the padded length must be padding"
        real = sorted_pairs[:n][sorted_pairs[:n] < pairs]
        assert real.tolist() == torch.sort(flat, stable=True).indices.tolist()
        for b in range(n // bm):
            blk = sorted_pairs[b * bm : (b + 1) * bm]
            blk = blk[blk < pairs]
            assert blk.numel() > 0, "a block below the padded length must hold a real pair"
            assert (flat[blk] == block_expert[b]).all()
        assert (block_expert[n // bm :] == e - 1).all(), "unused blocks: the last expert"


def check_fused_matches_reference(device: torch.device) -> None:
    from minisgl.kernels.moe import fused_moe

    # (tokens, experts, top_k, hidden, moe_intermediate): decode-sized, odd sizes, a
    # non-power-of-two intermediate, and enough pairs per expert for 32/64-row blocks.
    shapes = [(1, 8, 2, 64, 32), (37, 8, 2, 96, 48), (5, 16, 4, 64, 80), (300, 4, 2, 64, 32)]
    for dtype in (F32, BF16, F16):
        for seed, shape in enumerate(shapes):
            x, w13, w2, w, ids = moe_case(*shape, dtype=dtype, device=device, seed=seed)
            ref = moe_reference(x.cpu(), w13.cpu(), w2.cpu(), w.cpu(), ids.cpu())
            _close(fused_moe(x, w13, w2, w, ids), ref, dtype)


def check_fused_edge_cases(device: torch.device) -> None:
    from minisgl.kernels.moe import fused_moe

    x, w13, w2, w, ids = moe_case(9, 8, 2, 64, 32, F32, device, seed=3)
    # Every token on the same two experts: one long padded run, six empty experts.
    ids = torch.tensor([[5, 2]] * 9, device=device)
    ref = moe_reference(x.cpu(), w13.cpu(), w2.cpu(), w.cpu(), ids.cpu())
    _close(fused_moe(x, w13, w2, w, ids), ref, F32)
    # Rows of a wider buffer (row stride != hidden).
    wide = torch.randn(9, 80, generator=torch.Generator().manual_seed(4)).to(device)
    xs = wide[:, :64]
    ref = moe_reference(xs.cpu(), w13.cpu(), w2.cpu(), w.cpu(), ids.cpu())
    _close(fused_moe(xs, w13, w2, w, ids), ref, F32)
    empty = fused_moe(x[:0], w13, w2, w[:0], ids[:0])
    assert empty.shape == (0, 64)


def check_fused_no_host_sync(device: torch.device) -> None:
    """The CUDA path must be capturable in CUDA graphs: no device-to-host reads."""
    if device.type != "cuda":
        raise Skip("host syncs can only be detected on CUDA")
    from minisgl.kernels.moe import fused_moe

    args = moe_case(16, 8, 2, 64, 32, BF16, device, seed=5)
    kernel_checks.assert_no_host_sync(lambda: fused_moe(*args))


CHECKS = kernel_checks.collect(globals())


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.parametrize("name", sorted(CHECKS))
def test_kernel_interpreted(name: str) -> None:
    kernel_checks.interpreted(__file__, tuple(sorted(CHECKS)), name)


if __name__ == "__main__":
    kernel_checks.main(CHECKS)
