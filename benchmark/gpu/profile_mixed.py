"""Why mixed prefill+decode steps are slow on the GPU: time decode-only vs mixed steps and
break a mixed step's host time down by function.

Online at 16 req/s (benchmark/RESULTS.md) about 4% of ITLs are 20-40 ms: roughly one per
arriving request, i.e. the eager steps that carry a new prompt next to the running decodes
(since 20be0a2 such steps replay prefill/mixed CUDA graphs; --cuda-graph-max-tokens 0 to
see the eager cost).

    python benchmark/gpu/profile_mixed.py [--model benchmark/configs/Qwen3-0.6B]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from minisgl import LLM, SamplingParams  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_step(llm: LLM) -> float:
    _sync()
    t = time.perf_counter()
    llm.scheduler.step()
    _sync()
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="benchmark/configs/Qwen3-0.6B")
    ap.add_argument("--decodes", type=int, default=18)
    ap.add_argument("--prompt-len", type=int, default=560)
    ap.add_argument("--cuda-graph-max-tokens", type=int, default=None, help="0: mixed steps eager")
    args = ap.parse_args()
    llm = LLM(
        args.model,
        load_format="dummy",
        context_length=4096,
        disable_overlap_scheduling=True,
        cuda_graph_max_tokens=args.cuda_graph_max_tokens,
    )
    sched, rng = llm.scheduler, random.Random(0)
    vocab = min(10_000, llm.engine.model_config.vocab_size)
    long = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for _ in range(args.decodes):
        sched.add_request([rng.randrange(10, vocab) for _ in range(200)], long)
    for _ in range(20):
        sched.step()  # prefill them and warm every path (compiles happen here)
    decode = sorted(timed_step(llm) for _ in range(20))
    mixed = []
    for i in range(6):
        sched.add_request([rng.randrange(10, vocab) for _ in range(args.prompt_len)], long)
        if i == 5:
            prof = cProfile.Profile()
            prof.enable()
        mixed.append(timed_step(llm))
        for _ in range(3):
            sched.step()
    prof.disable()
    print(f"decode step ({args.decodes} rows, graph): median {decode[10]:.2f} ms")
    print(f"mixed step (+{args.prompt_len}-token prompt): {[round(m, 2) for m in mixed]} ms")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
