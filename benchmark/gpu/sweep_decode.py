"""Decode attention alone on the GPU: achieved bandwidth per KV element type and batch shape,
beside the card's measured copy bandwidth, over fp8 conversion modes x tiles.

    python benchmark/gpu/sweep_decode.py [--out rows.json] [--quick]

Qwen3-0.6B heads (Hq 16, Hk 8, D 128), page size 1 with shuffled slots. Shapes: uniform
batches (B x length) and the offline workload's real ragged batches at a few decode steps
(every live request, prompt + step tokens). Bandwidth counts the bytes the kernel must read:
K and V of every token before the new one, in the cache's element type, plus q. "engine" is
the launch the engine makes at this commit (its plan, tiles and fp8 mode); each variant
is also checked against the upcast kernel (mode 0) on the same pages. Runs on trees before
kernels/fp8_kv.py existed too (then only the upcast kernel, at that tree's tiles).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.offline.bench import workload  # noqa: E402

HQ, HK, D = 16, 8, 128
BF16_TILES = [(32, 4, 2), (64, 4, 2), (128, 4, 3), (128, 8, 3), (64, 4, 3), (256, 8, 2)]
FP8_TILES = [(32, 4, 1), (64, 4, 1), (128, 4, 1), (128, 8, 1), (256, 8, 1), (64, 4, 2),
             (128, 4, 3)]  # fmt: skip


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB device-to-device copy, bytes read plus written."""
    import triton.testing

    src = torch.randn(2**29, device="cuda")  # 2 GiB of float32
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(
        functools.partial(dst.copy_, src), warmup=20, rep=200, return_mode="median"
    )
    return 2 * 2**31 / ms / 1e6


def shapes(quick: bool) -> list[tuple[str, list[int]]]:
    """The offline workload's real ragged batches first (issue 25's bandwidth criterion is
    read on them), then uniform ones; small batches last (host-bound under do_bench)."""
    out = []
    prompts, max_tokens = workload()
    for step in (0, 320, 640) if not quick else (320,):
        lens = [len(p) + step for p, m in zip(prompts, max_tokens) if m > step]
        out.append((f"offline@{step}(B{len(lens)})", lens))
    return out + [
        (f"B{b}x{n}", [n] * b) for b, n in ((256, 1024), (64, 4096), (8, 4096), (1, 4096))
    ]


def variants(fp8: bool, has_modes: bool) -> list[tuple[int, tuple[int, int, int]]]:
    if not fp8:
        return [(0, t) for t in BF16_TILES]
    if not has_modes:
        return [(0, t) for t in BF16_TILES[:3]]
    old = [(0, t) for t in ((32, 4, 2), (64, 4, 2), (128, 4, 3))]
    return old + [(m, t) for m in (1, 2) for t in FP8_TILES] + [(3, (64, 4, 1)), (3, (128, 4, 1))]


class Case:
    """One batch in one cache type: pages, table, lengths, q."""

    def __init__(self, lens: list[int], kv_dtype: torch.dtype) -> None:
        from minisgl.kvcache.kv_dtype import to_kv_dtype

        n_tok, bsz = sum(lens), len(lens)
        g = torch.Generator(device="cuda").manual_seed(0)
        self.k = to_kv_dtype(torch.randn(n_tok + 1, HK, D, device="cuda", generator=g), kv_dtype)
        self.v = to_kv_dtype(torch.randn(n_tok + 1, HK, D, device="cuda", generator=g), kv_dtype)
        perm = torch.randperm(n_tok, device="cuda", generator=g).to(torch.int32)
        self.table = torch.zeros(bsz, max(lens), dtype=torch.int32, device="cuda")
        o = 0
        for i, n in enumerate(lens):
            self.table[i, :n] = perm[o : o + n]
            o += n
        self.rows = torch.arange(bsz, device="cuda", dtype=torch.int32)
        self.seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
        self.q = torch.randn(bsz, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
        kv_tokens = sum(max(n - 1, 0) for n in lens) + bsz  # the new token's K/V too
        self.gb = (kv_tokens * HK * D * 2 * self.k.element_size() + self.q.numel() * 2) / 1e9
        self.lens = lens


def run_one(case: Case, mode: int, tiles: tuple[int, int, int], has_modes: bool) -> Any:
    from minisgl.attention.base import padded_batch_size
    from minisgl.attention.triton_plan import decode_split_cap, plan_decode_splits
    from minisgl.kernels.decode_attention import decode_attention

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bsz = padded_batch_size(len(case.lens))
    cap = decode_split_cap(bsz, HK, sms, 16)
    block_n, warps, stages = tiles
    plan = plan_decode_splits(case.lens, HK, sms, cap, 64, block_n, batch=bsz)
    splits = torch.tensor(plan, device="cuda", dtype=torch.int32)
    kw: dict[str, Any] = {"block_n": block_n, "num_warps": warps, "num_stages": stages}
    if has_modes:
        from minisgl.kernels.fp8_kv import KVRead

        kw["kv"] = KVRead(mode=mode)
    return functools.partial(
        decode_attention, case.q, case.k, case.v, case.table, case.rows, case.seq_lens, splits,
        cap, D**-0.5, **kw,
    ), cap  # fmt: skip


def engine_launch(case: Case, fp8: bool, has_modes: bool) -> tuple[int, tuple[int, int, int]]:
    from minisgl.attention.base import padded_batch_size
    from minisgl.attention.triton_plan import decode_split_cap, decode_tiles

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cap = decode_split_cap(padded_batch_size(len(case.lens)), HK, sms, 16)
    if not has_modes:
        return 0, decode_tiles(cap)
    from minisgl.env import FP8_KV_MODE

    mode = int(FP8_KV_MODE.get()) if fp8 else 0
    return mode, decode_tiles(cap, fp8 and mode != 0)


def sweep_case(name: str, case: Case, fp8: bool, has_modes: bool, copy_gbs: float) -> list[dict]:
    import triton.testing

    ref = run_one(case, 0, (64, 4, 2), has_modes)[0]().float()
    eng = engine_launch(case, fp8, has_modes)
    todo = [eng] + [v for v in variants(fp8, has_modes) if v != eng]
    rows = []
    for i, (mode, tiles) in enumerate(todo):
        try:
            run, cap = run_one(case, mode, tiles, has_modes)
            err = ((run().float() - ref).norm() / ref.norm()).item()
            ms = triton.testing.do_bench(run, warmup=5, rep=25, return_mode="median")
        except Exception as e:  # out of resources for this tile
            print(f"  {name} mode {mode} {tiles}: {type(e).__name__}: {str(e)[:120]}")
            continue
        gbs = case.gb / ms * 1e3
        rows.append({"shape": name, "fp8": fp8, "engine": i == 0, "mode": mode, "tiles": tiles,
                     "splits": cap, "us": ms * 1e3, "GBps": gbs, "of_copy": gbs / copy_gbs,
                     "rel_err": err})  # fmt: skip
    return rows


def extend_timings(has_modes: bool) -> None:
    """Prefill attention (extend kernel) over each cache type and fp8 mode: 8 fresh 1,024-
    token prompts, and 4 chunks of 512 tokens after 2,048 cached ones."""
    import triton.testing

    from minisgl.attention.base import BatchLayout
    from minisgl.attention.triton_backend import TritonBackend
    from minisgl.kvcache.pool import KVPool

    for prefix, ext in (([0] * 8, [1024] * 8), ([2048] * 4, [512] * 4)):
        seq = [p + e for p, e in zip(prefix, ext)]
        table = torch.randperm(sum(seq), device="cuda").to(torch.int32).view(len(seq), -1)
        layout = BatchLayout(list(range(len(seq))), prefix, ext, table)
        q = torch.randn(sum(ext), HQ, D, device="cuda", dtype=torch.bfloat16)
        line = []
        for kv_dtype, modes in ((torch.bfloat16, [0]), (torch.float8_e4m3fn, [0, 1, 2])):
            pool = KVPool(1, sum(seq), 1, HK, D, kv_dtype, torch.device("cuda"))
            pool.buffer.copy_(torch.randn(pool.buffer.shape, device="cuda").clamp(-8, 8))
            for mode in modes if has_modes else [0]:
                kw = {"fp8_mode": mode} if has_modes else {}
                backend = TritonBackend(pool, **kw)  # type: ignore[arg-type]
                md = backend.prepare(layout, torch.device("cuda"))
                run = functools.partial(backend.attend, q, 0, md, D**-0.5)
                ms = triton.testing.do_bench(run, warmup=5, rep=25, return_mode="median")
                line.append(f"{str(kv_dtype)[6:]} m{mode} {ms * 1e3:.0f}us")
        print(f"extend prefix {prefix[0]} + {ext[0]} x{len(ext)}: " + ", ".join(line), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    try:
        import minisgl.kernels.fp8_kv  # noqa: F401

        has_modes = True
    except ImportError:
        has_modes = False
    copy_gbs = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}: copy {copy_gbs:.0f} GB/s (read + write)")
    rows: list[dict] = []
    for name, lens in shapes(args.quick):
        for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            fp8 = kv_dtype != torch.bfloat16
            case = Case(lens, kv_dtype)
            got = sweep_case(name, case, fp8, has_modes, copy_gbs)
            rows += got
            report(name, "e4m3" if fp8 else "bf16", case.gb, got)
            del case
    extend_timings(has_modes)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=0))


def report(name: str, kind: str, gb: float, rows: list[dict]) -> None:
    if not rows:
        print(f"{name} {kind}: no result")
        return
    eng = [r for r in rows if r["engine"]]
    best = sorted(rows, key=lambda r: r["us"])[:3]
    worst_err = max(r["rel_err"] for r in rows)

    def fmt(r: dict) -> str:
        n, w, s = r["tiles"]
        return (f"m{r['mode']} n{n}w{w}s{s} S{r['splits']} {r['us']:.1f}us "
                f"{r['GBps']:.0f}GB/s ({100 * r['of_copy']:.0f}%)")  # fmt: skip

    e = fmt(eng[0]) if eng else "-"
    print(f"{name} {kind} ({gb * 1e3:.0f} MB): engine {e} | best " + ", ".join(map(fmt, best))
          + f" | max rel err {worst_err:.1e}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
