"""An e4m3 KV cache against the model-dtype cache on real weights (the bundled model, CPU),
teacher-forced over the first 6,000 characters of seed 003 (1,426 scored positions): top-1
agreement and the reference token's logprob (issue 25). Measured 2026-12-05 (RESULTS.md):
93.7% and 0.100 nats with scale 1.0; per-layer scales calibrated on that prefill
(max |K|, |V| / 448) gave 93.1% and 0.098, not better, so 1.0 stays."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams

SEED = Path(__file__).resolve().parents[4] / "shared" / "seeds" / "003_105319d6552938ff.txt"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not SEED.exists(), reason="needs ../shared/seeds beside the checkout"),
]


def _scored(kv: str, text: str) -> tuple[torch.Tensor, list[int | None]]:
    llm = LLM(None, kv_cache_dtype=kv)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    out = llm.generate([llm.encode(text)], params, use_tqdm=False)[0]
    llm.close()
    top = [max(d, key=d.get) if d else None for d in out["prompt_top_logprobs"][1:]]
    return torch.tensor(out["prompt_logprobs"][1:]), top


def test_e4m3_cache_top1_and_logprob_on_real_weights() -> None:
    text = SEED.read_text()[:6000]
    ref_lp, ref_top = _scored("auto", text)
    lp, top = _scored("fp8_e4m3", text)
    agree = sum(a == b for a, b in zip(top, ref_top)) / len(top)
    assert len(top) > 1400
    assert agree >= 0.93, agree
    assert (lp - ref_lp).abs().mean().item() <= 0.11
