"""L2 prefetch (kernels/prefetch.py) on the H200: batch-1 GEMV time on a cold L2, with and
without the weight prefetched during a gap of idle memory bus before it (a sleep kernel
standing in for RoPE + attention or the TP all-reduce), and the prefetch kernel's own time.

    python benchmark/gpu/bench_prefetch.py [--shapes 8B] [--gaps 0 5 10 20]

Each timed call follows a 256 MB write that evicts L2, as a decode step's 36 layers of
weights do between two reads of one layer's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = {
    "8B qkv": (6144, 4096),
    "8B o": (4096, 4096),
    "8B gate_up": (24576, 4096),
    "8B down": (4096, 12288),
    "8B-tp2 qkv": (3072, 4096),
    "8B-tp2 o": (4096, 2048),
    "8B-tp2 gate_up": (12288, 4096),
    "8B-tp2 down": (4096, 6144),
    "0.6B o": (1024, 2048),
}


def main() -> None:
    from minisgl.kernels.gemv import gemv, gemv_choice
    from minisgl.kernels.prefetch import prefetch_l2

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8B")
    ap.add_argument("--gaps", type=float, nargs="+", default=[0, 5, 10, 20])
    ap.add_argument("--mb", type=float, nargs="+", default=[0], help="prefetch caps, 0 = all")
    ap.add_argument("--iters", type=int, default=40)
    args = ap.parse_args()
    dev = torch.device("cuda")
    clock_hz = torch.cuda.get_device_properties(dev).clock_rate * 1e3
    scratch = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    x = torch.randn(1, 16384, dtype=torch.bfloat16, device=dev)

    def timed(fn, before) -> float:  # type: ignore[no-untyped-def]
        times = []
        for _ in range(args.iters):
            scratch.fill_(1)
            before()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) * 1e3)
        return statistics.median(times)

    for name, (n, k) in SHAPES.items():
        if not name.startswith(args.shapes + " "):
            continue
        w = torch.randn(n, k, dtype=torch.bfloat16, device=dev) / k**0.5
        xi = x[:, :k]
        tiles = gemv_choice(1, n, k)

        def product(w: torch.Tensor = w, xi: torch.Tensor = xi, t: object = tiles) -> None:
            gemv(xi, w, None, t) if t is not None else torch.nn.functional.linear(xi, w)  # type: ignore[arg-type]

        product()
        mb = n * k * 2 / 2**20
        t_pf = timed(lambda w=w: prefetch_l2(w), lambda: None)
        line = [
            f"{name:15s} {mb:6.1f} MB {'cuBLAS' if tiles is None else 'GEMV'} pf kernel {t_pf:4.1f} us"
        ]
        for gap in args.gaps:
            cycles = int(gap * 1e-6 * clock_hz)

            def sleep(c: int = cycles) -> None:
                if c:
                    torch.cuda._sleep(c)

            cold = timed(product, sleep)
            for cap in args.mb:
                cap_b = int(cap * 2**20) or None

                def pf_sleep(c: int = cycles, b: int | None = cap_b, w: torch.Tensor = w) -> None:
                    prefetch_l2(w, b)
                    sleep(c)

                warm = timed(product, pf_sleep)
                tag = f"{cap:g}MB" if cap else "all"
                line.append(f"gap {gap:g}us: cold {cold:5.1f} / pf[{tag}] {warm:5.1f}")
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
