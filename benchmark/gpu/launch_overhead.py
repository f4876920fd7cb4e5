"""Host cost of one eager launch of each kernel wrapper (no sync): where an eager forward's
time goes when the GPU is idle (batch-1 eager decode is ~16 ms for 28 layers).

    python benchmark/gpu/launch_overhead.py
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def per_call_us(fn: Callable[[], object], n: int = 2000) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    el = time.perf_counter() - t
    torch.cuda.synchronize()
    return el / n * 1e6


def main() -> None:
    from minisgl.kernels.activation import silu_and_mul
    from minisgl.kernels.norm import fused_add_rms_norm, rms_norm
    from minisgl.kernels.rope import apply_rope
    from minisgl.kernels.store import store_kv

    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(1, 1024, device=dev, dtype=bf)
    r = torch.randn(1, 1024, device=dev, dtype=bf)
    w = torch.ones(1024, device=dev, dtype=bf)
    qk = torch.randn(1, 16, 128, device=dev, dtype=bf)
    gu = torch.randn(1, 6144, device=dev, dtype=bf)
    lin = torch.nn.Linear(1024, 2048, bias=False, device=dev, dtype=bf)
    pos = torch.zeros(1, dtype=torch.long, device=dev)
    cos_sin = torch.randn(4096, 128, device=dev, dtype=torch.float32)
    kc = torch.randn(64, 8, 128, device=dev, dtype=bf)
    k = torch.randn(1, 8, 128, device=dev, dtype=bf)
    slots = torch.zeros(1, dtype=torch.long, device=dev)
    cases: dict[str, Callable[[], object]] = {
        "torch.add": lambda: torch.add(x, r),
        "F.linear 1x1024x2048": lambda: lin(x),
        "rms_norm": lambda: rms_norm(x, w, 1e-6),
        "fused_add_rms_norm": lambda: fused_add_rms_norm(x, r, w, 1e-6),
        "q_norm (16 heads)": lambda: rms_norm(qk, w[:128], 1e-6),
        "silu_and_mul": lambda: silu_and_mul(gu),
        "store_kv": lambda: store_kv(kc, kc, k, k, slots),
    }
    cases["apply_rope"] = lambda: apply_rope(pos, qk, k, cos_sin, cos_sin)
    for name, fn in cases.items():
        print(f"{name:28s} {per_call_us(fn):7.1f} us/call")


if __name__ == "__main__":
    main()
