"""Decode attention on the offline workload's real (ragged) batches: split plans x tiles.

At decode step s the live rows are the requests with max_tokens > s, each with
prompt_len + s tokens. The uniform-length sweep (sweep_decode.py) hides the tail effect of
ragged rows: one program per (row, KV head) finishes when its longest row does.

    python benchmark/gpu/sweep_ragged.py
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.offline.bench import workload  # noqa: E402


def main() -> None:
    import triton.testing

    from minisgl.attention.triton_plan import (
        decode_split_cap,
        decode_tiles,
        plan_decode_splits,
    )
    from minisgl.kernels.decode_attention import decode_attention

    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    hq, hk, d = 16, 8, 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    prompts, max_tokens = workload()
    plens = [len(p) for p in prompts]
    tiles = [(32, 2, 3), (64, 2, 3), (64, 4, 2), (64, 4, 3), (128, 4, 3), (128, 4, 4), (128, 8, 3)]
    rows_out = []
    for step in range(0, 1024, 64):
        lens = [p + step for p, m in zip(plens, max_tokens) if m > step]
        bsz = len(lens)
        n_tok = sum(lens)
        k_cache = torch.randn(n_tok + 1, hk, d, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        perm = torch.randperm(n_tok, device="cuda", dtype=torch.int32)
        table = torch.zeros(bsz, max(lens), dtype=torch.int32, device="cuda")
        o = 0
        for i, n in enumerate(lens):
            table[i, :n] = perm[o : o + n]
            o += n
        rows = torch.arange(bsz, device="cuda", dtype=torch.int32)
        seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
        q = torch.randn(bsz, hq, d, device="cuda", dtype=torch.bfloat16)
        gb = n_tok * hk * d * 2 * 2 / 1e9
        cases: list[tuple[str, list[int], int, dict[str, int], int]] = []
        # The engine's own policy, as it stands at this commit.
        cap = decode_split_cap(bsz, hk, sms, 16)
        bn, w, st = decode_tiles(cap)
        plan = plan_decode_splits(lens, hk, sms, cap, 64, bn)
        cases.append(("engine", plan, cap, {"num_warps": w, "num_stages": st}, bn))
        for waves in (1, 2, 4, 8, 16):
            for min_chunk in (128, 256):
                for n, w, st in tiles:
                    cap = decode_split_cap(bsz, hk, sms, 16, waves)
                    plan = plan_decode_splits(lens, hk, sms, 16, min_chunk, n, waves)
                    name = f"w{waves}/m{min_chunk}/n{n}w{w}s{st}"
                    cases.append((name, plan, cap, {"num_warps": w, "num_stages": st}, n))
        res = []
        for name, plan, cap, launch, block_n in cases:
            splits = torch.tensor(plan, device="cuda", dtype=torch.int32)
            run = functools.partial(
                decode_attention, q, k_cache, v_cache, table, rows, seq_lens, splits,
                cap, d**-0.5, block_n=block_n, **launch,
            )  # fmt: skip
            try:
                ms = triton.testing.do_bench(run, warmup=5, rep=20)
            except Exception as e:
                print(f"  {name}: {type(e).__name__}")
                continue
            res.append((ms, name, cap))
            rows_out.append(
                {"step": step, "B": bsz, "gb": gb, "case": name, "cap": cap, "us": ms * 1e3}
            )
        res.sort()
        best = ", ".join(f"{nm}(S{s}) {ms * 1e3:.0f}us {gb / ms:.2f}" for ms, nm, s in res[:3])
        eng = [r for r in res if r[1] == "engine"]
        e = f"engine(S{eng[0][2]}) {eng[0][0] * 1e3:.0f}us | " if eng else ""
        print(
            f"step {step}: B={bsz} max {max(lens)} mean {n_tok // bsz}: {e}best {best}", flush=True
        )
    if out_path:
        with open(out_path, "w") as f:
            json.dump(rows_out, f)


if __name__ == "__main__":
    main()
