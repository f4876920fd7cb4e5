"""CPU throughput of the default model beside Hugging Face transformers, same run, same machine.

Batch 1: one request. Batch 16: sixteen requests at once for minisgl, and the same sixteen run
one after another through HF ``generate`` (HF has no continuous batching for ragged prompts).
Greedy, ignore EOS, fixed output length; output tokens / wall time.

    python benchmark/offline/bench_cpu_vs_hf.py --max-tokens 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.report import emit  # noqa: E402
from minisgl import LLM, SamplingParams  # noqa: E402
from minisgl.models.default_model import default_model_path  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity simply.",
    "List three prime numbers.",
    "What is a radix tree?",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Translate 'good morning' to Spanish.",
    "What is 12 times 13?",
    "Name a famous painter.",
    "How do bees make honey?",
    "Describe a cat in one sentence.",
    "What does a compiler do?",
    "Suggest a name for a dog.",
    "What is photosynthesis?",
    "Tell me a fun fact about octopuses.",
]


def hf_run(model, prompts: list[list[int]], max_tokens: int) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    for ids in prompts:
        with torch.inference_mode():
            model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    path = default_model_path()
    llm = LLM()
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    # Warm both up.
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    hf_run(hf, prompts[:1], 8)

    results: dict[str, float] = {}
    for bs in (1, 16):
        batch = prompts[:bs]
        n_out = bs * args.max_tokens
        t0 = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        ours = time.perf_counter() - t0
        theirs = hf_run(hf, batch, args.max_tokens)
        results[f"minisgl_bs{bs}_tok_s"] = round(n_out / ours, 1)
        results[f"hf_bs{bs}_tok_s"] = round(n_out / theirs, 1)
        results[f"speedup_bs{bs}"] = round(theirs / ours, 2)
        print(
            f"batch {bs}: minisgl {n_out / ours:.1f} tok/s, HF {n_out / theirs:.1f} tok/s "
            f"({theirs / ours:.2f}x)"
        )
    line = {
        "bench": "cpu_vs_hf",
        "max_tokens": args.max_tokens,
        "threads": torch.get_num_threads(),
        **results,
    }
    emit(line, args.output)


if __name__ == "__main__":
    main()
