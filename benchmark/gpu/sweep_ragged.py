"""Decode attention on the offline workload's real (ragged) batches: split plans x tiles.

At decode step s the live rows are the requests with max_tokens > s, each with
prompt_len + s tokens. The uniform-length sweep (sweep_decode.py) hides the tail effect of
ragged rows: one program per (row, KV head) finishes when its longest row does.

    python benchmark/gpu/sweep_ragged.py
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.offline.bench import workload  # noqa: E402
from minisgl.kernels import cdiv  # noqa: E402


def balanced_plan(
    lens: list[int], hk: int, programs: int, min_chunk: int, block_n: int
) -> list[int]:
    """Chunk so that about ``programs`` equal-sized programs cover every row's KV."""
    total = sum(lens) * hk
    chunk = max(min_chunk, cdiv(cdiv(total, programs), block_n) * block_n)
    return [max(1, cdiv(n, chunk)) for n in lens]


def main() -> None:
    import triton.testing

    from minisgl.attention.triton_backend import (
        _decode_launch,
        decode_split_cap,
        plan_decode_splits,
    )
    from minisgl.kernels.attention import decode_attention

    hq, hk, d = 16, 8, 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    prompts, max_tokens = workload()
    plens = [len(p) for p in prompts]
    tiles = [(32, 2, 3), (32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 4, 4), (64, 8, 3)]
    total_ms: dict[str, float] = {}
    for step in (0, 200, 400, 600, 800, 900, 960, 1000):
        lens = [p + step for p, m in zip(plens, max_tokens) if m > step]
        bsz = len(lens)
        n_tok = sum(lens)
        k_cache = torch.randn(n_tok + 1, hk, d, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        width = max(lens)
        perm = torch.randperm(n_tok, device="cuda", dtype=torch.int32)
        table = torch.zeros(bsz, width, dtype=torch.int32, device="cuda")
        o = 0
        for i, n in enumerate(lens):
            table[i, :n] = perm[o : o + n]
            o += n
        rows = torch.arange(bsz, device="cuda", dtype=torch.int32)
        seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
        q = torch.randn(bsz, hq, d, device="cuda", dtype=torch.bfloat16)
        gb = n_tok * hk * d * 2 * 2 / 1e9
        cases: list[tuple[str, list[int], int, dict[str, int], int]] = []
        ms_cap = decode_split_cap(bsz, hk, sms, 16)
        cur = plan_decode_splits(lens, hk, sms, ms_cap, 256, 32)
        cases.append(("current", cur, ms_cap, _decode_launch(ms_cap), 32))
        for n, w, s in tiles:
            for waves in (2, 4, 8):
                for min_chunk in (128, 256, 512):
                    plan = balanced_plan(lens, hk, waves * sms, min_chunk, n)
                    name = f"bal{waves}w/min{min_chunk}/n{n}w{w}s{s}"
                    cases.append((name, plan, max(plan), {"num_warps": w, "num_stages": s}, n))
        res = []
        for name, plan, max_splits, launch, block_n in cases:
            splits = torch.tensor(plan, device="cuda", dtype=torch.int32)
            run = functools.partial(
                decode_attention, q, k_cache, v_cache, table, rows, seq_lens, splits,
                max_splits, d**-0.5, block_n=block_n, **launch,
            )  # fmt: skip
            try:
                ms = triton.testing.do_bench(run, warmup=5, rep=25)
            except Exception as e:
                print(f"  {name}: {type(e).__name__}")
                continue
            res.append((ms, name, max_splits))
            total_ms[name] = total_ms.get(name, 0.0) + ms
        res.sort()
        c = next(r for r in res if r[1] == "current")
        best = ", ".join(f"{nm}(S{s}) {ms * 1e3:.0f}us {gb / ms:.2f}" for ms, nm, s in res[:4])
        print(
            f"step {step}: B={bsz} max {max(lens)} mean {n_tok // bsz}: current(S{c[2]}) "
            f"{c[0] * 1e3:.0f}us {gb / c[0]:.2f}TB/s | best {best}",
            flush=True,
        )
    ranked = sorted(total_ms.items(), key=lambda kv: kv[1])
    print("sum over steps (ms):", ", ".join(f"{k} {v:.3f}" for k, v in ranked[:8]))
    print("current sum:", f"{total_ms['current']:.3f}")


if __name__ == "__main__":
    main()
