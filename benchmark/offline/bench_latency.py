"""Batch-1 decode latency: milliseconds per output token after the first.

    python benchmark/offline/bench_latency.py --model benchmark/configs/Qwen3-8B --load-format dummy

ms/token = (time for 1 + N tokens - time for 1 token) / N, for one request with a 128-token
prompt, ignore_eos, greedy unless --temperature is given; each measured as the best of a few
repeats.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.report import add_engine_arg, emit, engine_options  # noqa: E402
from minisgl import LLM, SamplingParams  # noqa: E402


def timed(llm: LLM, prompt: list[int], n: int, repeats: int, temperature: float = 0.0) -> float:
    best = float("inf")
    params = SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True)
    for _ in range(repeats):
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
    return best


def set_tuning(gemv_table: str | None, int4_tiles: str | None, fp8_table: str | None) -> None:
    """Tile overrides for tuning runs (CUDA only: the kernels import triton)."""
    if fp8_table:
        from minisgl.extensions.quantization.kernels import fp8_gemv

        fp8_gemv.load_table(fp8_table)
    if gemv_table:
        from minisgl.kernels import gemv

        gemv.load_table(gemv_table)
    if int4_tiles:
        from minisgl.extensions.quantization.kernels import int4_gemv

        bn, bk, warps, stages = (int(v) for v in int4_tiles.split(","))
        int4_gemv.TILES_OVERRIDE = (bn, bk, warps, stages)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    add_engine_arg(ap)
    ap.add_argument("--output", default=None)
    ap.add_argument(
        "--gemv-table", default=None, help="JSON of bench_gemv.py --write-table: GEMV tiles"
    )
    ap.add_argument(
        "--int4-gemv-tiles", default=None, help="BLOCK_N,BLOCK_K,warps,stages for int4 GEMVs"
    )
    ap.add_argument("--fp8-gemv-table", default=None, help="JSON of bench_fp8.py --write-table")
    args = ap.parse_args()
    set_tuning(args.gemv_table, args.int4_gemv_tiles, args.fp8_gemv_table)
    options = engine_options(args.engine_arg, load_format=args.load_format, context_length=4096)
    llm = LLM(args.model, **options)  # type: ignore[arg-type]
    prompt = [(7 * i) % 1000 + 10 for i in range(128)]
    temp = args.temperature
    timed(llm, prompt, 8, 1, temp)  # warm-up
    first = timed(llm, prompt, 1, args.repeats, temp)
    total = timed(llm, prompt, 1 + args.tokens, args.repeats, temp)
    ms = (total - first) / args.tokens * 1000
    result = {
        "bench": "latency_bs1",
        "model": args.model or "default",
        "ttft_ms": round(first * 1000, 2),
        "decode_ms_per_token": round(ms, 3),
        "temperature": temp,
        "options": options,
    }
    print(f"TTFT {first * 1000:.1f} ms, decode {ms:.3f} ms/token (temperature {temp})")
    emit(result, args.output)


if __name__ == "__main__":
    main()
