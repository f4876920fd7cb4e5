"""Speculative decoding on a repeat/edit workload: tokens/s with and without drafts.

The model is asked to repeat (or lightly edit) a given passage, as in code-edit and
retrieval traffic; batch 1, greedy. Runs without speculation, with n-gram drafts and, given
``--draft-model``, with that draft model; every speculative run must reproduce the plain
run's tokens. The 1-minute load average is printed with the figures (the dev box is shared).

    python benchmark/offline/bench_spec.py --num-steps 4 [--draft-model PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.report import emit  # noqa: E402
from minisgl import LLM, SamplingParams  # noqa: E402

PASSAGE = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a "
    "single step. To be or not to be, that is the question. All that glitters is not gold. "
    "The early bird catches the worm, but the second mouse gets the cheese."
)
CODE = """def merge_sorted(left, right):
    result = []
    i = 0
    j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i])
            i += 1
        else:
            result.append(right[j])
            j += 1
    result.extend(left[i:])
    result.extend(right[j:])
    return result


def merge_sort(items):
    if len(items) <= 1:
        return items
    middle = len(items) // 2
    left = merge_sort(items[:middle])
    right = merge_sort(items[middle:])
    return merge_sorted(left, right)
"""
# Code edits that return the whole file, and a verbatim repeat: most output tokens copy
# the prompt, as in code-edit and retrieval traffic.
TASKS = [
    "Rename the function merge_sorted to merge_lists everywhere in this code and output the "
    f"full code:\n\n```python\n{CODE}```",
    f"Add a docstring to merge_sort and output the whole file unchanged otherwise:\n\n```python\n{CODE}```",
    f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}",
]


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.scheduler.flush_cache()  # every run prefills its prompts in full
    t0 = time.perf_counter()
    outs = [llm.generate([p], params, use_tqdm=False)[0]["token_ids"] for p in prompts]
    return time.perf_counter() - t0, sum(map(len, outs)), outs


def measure(llm: LLM, max_tokens: int, repeats: int) -> tuple[dict[str, Any], list[list[int]]]:
    prompts = [llm.apply_chat_template([{"role": "user", "content": t}]) for t in TASKS]
    run(llm, prompts[:1], 8)  # warm-up
    stats0 = dict(llm.scheduler.stats)
    load0 = os.getloadavg()[0]
    # The best of a few repeats: the machine is shared, and other jobs only ever slow it.
    secs, n, outs = min((run(llm, prompts, max_tokens) for _ in range(repeats)), key=lambda r: r[0])
    s = llm.scheduler.stats
    rows = s["spec_rows"] - stats0["spec_rows"]
    acc = s["spec_accepted"] - stats0["spec_accepted"]
    return {
        "tok_s": round(n / secs, 2), "tokens": n, "seconds": round(secs, 2),
        # tokens emitted per verifying step (1 + accepted drafts)
        "accept_len": round(1 + acc / rows, 2) if rows else None,
        "load_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
    }, outs  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-steps", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--draft-model", default=None, help="also run draft-model speculation")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    modes: dict[str, dict[str, Any]] = {
        "none": {},
        "ngram": {"speculative_algorithm": "ngram"},
    }
    if args.draft_model:
        modes["draft"] = {"speculative_draft_model": args.draft_model}
    results: dict[str, Any] = {}
    outputs = {}
    for name, options in modes.items():
        llm = LLM(args.model, speculative_num_steps=args.num_steps, **options)
        results[name], outputs[name] = measure(llm, args.max_tokens, args.repeats)
        print(name, results[name], flush=True)
        del llm
    for name in modes:
        assert outputs[name] == outputs["none"], f"{name} speculation changed greedy outputs"
    line = {"bench": "spec_bs1", "num_steps": args.num_steps, **results}
    for name in modes:
        if name != "none":
            line[f"speedup_{name}"] = round(results[name]["tok_s"] / results["none"]["tok_s"], 2)
    emit(line, args.output)


if __name__ == "__main__":
    main()
