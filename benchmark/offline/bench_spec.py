"""Speculative decoding on a repeat/edit workload: tokens/s with and without n-gram drafts.

The model is asked to repeat (or lightly edit) a given passage, as in code-edit and
retrieval traffic; batch 1, greedy.

    python benchmark/offline/bench_spec.py --num-steps 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from minisgl import LLM, SamplingParams  # noqa: E402

PASSAGE = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a "
    "single step. To be or not to be, that is the question. All that glitters is not gold. "
    "The early bird catches the worm, but the second mouse gets the cheese."
)
TASKS = [
    f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite the following passage, replacing 'fox' with 'cat' and changing nothing else:\n\n{PASSAGE}",
]


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    outs = [llm.generate([p], params, use_tqdm=False)[0]["token_ids"] for p in prompts]
    return time.perf_counter() - t0, sum(map(len, outs)), outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-steps", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    results = {}
    outputs = {}
    for spec in (None, "ngram"):
        llm = LLM(args.model, speculative_algorithm=spec, speculative_num_steps=args.num_steps)
        prompts = [llm.apply_chat_template([{"role": "user", "content": t}]) for t in TASKS]
        run(llm, prompts[:1], 8)  # warm-up
        stats0 = dict(llm.scheduler.stats)
        secs, n, outs = run(llm, prompts, args.max_tokens)
        rows = llm.scheduler.stats.get("spec_rows", 0) - stats0.get("spec_rows", 0)
        acc = llm.scheduler.stats.get("spec_accepted", 0) - stats0.get("spec_accepted", 0)
        name = spec or "none"
        outputs[name] = outs
        results[name] = {
            "tok_s": round(n / secs, 2),
            "tokens": n,
            "seconds": round(secs, 2),
            # tokens emitted per verifying step (1 + accepted drafts)
            "accept_len": round(1 + acc / rows, 2) if rows else None,
        }
        print(name, results[name])
    assert outputs["none"] == outputs["ngram"], "speculation changed greedy outputs"
    line = {
        "bench": "spec_ngram_bs1",
        "num_steps": args.num_steps,
        **results,
        "speedup": round(results["ngram"]["tok_s"] / results["none"]["tok_s"], 2),
    }
    print(json.dumps(line))
    if args.output:
        with open(args.output, "a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
