"""Greedy tokens at TP=1 and TP=2 on the same weights (issue: TP on two GPUs): the first
``--tokens`` tokens of a few prompts, and where each pair first differs.

    python benchmark/gpu/tp_equality.py --model benchmark/configs/Qwen3-8B --load-format dummy

Dummy weights are one random checkpoint that every rank shards (models/loader.py), so both
runs hold the same model. The two runs sum partial products in another order (all-reduce),
so in 16-bit a near-tie can flip a token; ``--dtype float32`` shows whether any difference
is rounding. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from minisgl import LLM, SamplingParams  # noqa: E402

PROMPT_LENS = (16, 56, 96, 136)


def greedy(model: str, load_format: str, dtype: str, tp: int, tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    with LLM(model, load_format=load_format, dtype=dtype, tp_size=tp, context_length=1024) as llm:
        vocab = llm.engine.model_config.vocab_size
        prompts = [[(7 * i + 13 * n) % (vocab - 10) + 10 for i in range(n)] for n in PROMPT_LENS]
        out = [r["token_ids"] for r in llm.generate(prompts, params, use_tqdm=False)]
    # The engine's KV pool (most of the GPU) must be freed before the next run sizes its own:
    # else the TP=2 run's rank 0, in this process, finds no memory left for a pool.
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    runs = {tp: greedy(args.model, args.load_format, args.dtype, tp, args.tokens) for tp in (1, 2)}
    diffs = [first_difference(a, b) for a, b in zip(runs[1], runs[2])]
    result = {
        "bench": "tp_equality",
        "model": args.model,
        "dtype": args.dtype,
        "tokens": args.tokens,
        "equal": all(d is None for d in diffs),
        "first_difference": diffs,
        "tp1": runs[1],
        "tp2": runs[2],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
