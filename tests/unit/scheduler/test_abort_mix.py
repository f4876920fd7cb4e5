"""Aborts in a mixed batch under overlap scheduling, on the CPU: long decodes beside short
repeated prompts that finish in their first steps, every third request aborted at varied
steps (waiting, mid-decode, right after its last token was launched). Survivors' greedy
tokens equal a no-overlap run's, and nothing leaks. (tests/gpu/test_abort_overlap_gpu.py
runs the same with CUDA graphs and a device that lags the host.)"""

from __future__ import annotations

from pathlib import Path

from minisgl import LLM, SamplingParams
from tests.helpers import assert_engine_clean
from tests.workloads import check_abort_mix, run_abort_mix


def test_aborts_in_a_mixed_batch_under_overlap(tiny_models: dict[str, Path]) -> None:
    llm = LLM(str(tiny_models["qwen3"]), chunked_prefill_size=64, page_size=4)
    s = llm.scheduler
    s.overlap = False
    ref, ref_aborted = run_abort_mix(llm, long_tokens=(6, 10))
    check_abort_mix(ref, ref_aborted, ref, overlap=False)
    assert_engine_clean(llm)
    s.overlap = True  # what CUDA runs by default
    reqs, aborted = run_abort_mix(llm, long_tokens=(6, 10))
    check_abort_mix(reqs, aborted, ref, overlap=True)
    assert_engine_clean(llm)
    # The engine keeps serving.
    two = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    assert llm.generate([ref[1].prompt_ids], two)[0]["token_ids"] == ref[3].output_ids
    assert_engine_clean(llm)
