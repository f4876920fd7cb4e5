"""Greedy outputs of every architecture equal Hugging Face transformers token for token."""

from __future__ import annotations

from pathlib import Path

import pytest

from minisgl import LLM, SamplingParams
from tests.helpers import TinyModels, assert_engine_clean, hf_greedy

PROMPTS = [
    [5, 6, 7],
    [10, 11, 12, 13, 14, 15, 16, 17, 18],
    [3] * 21,
    [100, 101],
    list(range(40, 73)),
]
N_NEW = 24


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_matches_hf(tiny_models: dict[str, Path], arch: str, page_size: int) -> None:
    path = tiny_models[arch]
    ref_tokens, ref_logprobs = hf_greedy(path, PROMPTS, N_NEW)
    llm = LLM(str(path), page_size=page_size)
    out = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=True)
    )
    for res, toks, lps in zip(out, ref_tokens, ref_logprobs):
        assert res["token_ids"] == toks
        assert res["finish_reason"] == "length"
        assert max(abs(a - b) for a, b in zip(res["logprobs"], lps)) < 1e-4
    assert_engine_clean(llm)


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
        ),
        (
            "qwen2",
            {
                "rope_scaling": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 128,
                }
            },
        ),
        ("llama", {"tie_word_embeddings": True, "attention_bias": True}),
        ("qwen3", {"tie_word_embeddings": True, "rope_theta": 500.0}),
    ],
)
def test_rope_variants_and_tying_match_hf(
    tiny_models: TinyModels, arch: str, overrides: dict
) -> None:
    path = tiny_models.build(arch, seed=1, **overrides)
    prompts = [list(range(1, 80)), [7, 8, 9]]
    ref_tokens, ref_logprobs = hf_greedy(path, prompts, 16)
    llm = LLM(str(path))
    out = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=True)
    )
    for res, toks, lps in zip(out, ref_tokens, ref_logprobs):
        assert res["token_ids"] == toks
        assert max(abs(a - b) for a, b in zip(res["logprobs"], lps)) < 1e-4


def test_sharded_safetensors_with_index(tiny_models: TinyModels, tmp_path: Path) -> None:
    """A checkpoint split over several files with model.safetensors.index.json loads the same."""
    from transformers import AutoModelForCausalLM

    path = tiny_models.build("qwen3", seed=3)
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(path).save_pretrained(sharded, max_shard_size="100KB")
    for f in path.glob("tokenizer*"):
        (sharded / f.name).write_bytes(f.read_bytes())
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a = LLM(str(path)).generate([[4, 5, 6, 7]], params)[0]["token_ids"]
    b = LLM(str(sharded)).generate([[4, 5, 6, 7]], params)[0]["token_ids"]
    assert a == b


@pytest.mark.parametrize("chunk", [8192, 7])
def test_prompt_logprobs_match_hf(tiny_models: dict[str, Path], chunk: int) -> None:
    """Prompt logprobs (what `echo` + `logprobs` scoring uses) equal HF's, also across chunks
    and when the prompt is already in the prefix cache."""
    import torch
    from transformers import AutoModelForCausalLM

    path = tiny_models["qwen2"]
    prompt = list(range(30, 60))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    expected = logp[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
    top2 = logp[:-1].topk(2, -1).indices.tolist()
    llm = LLM(str(path), chunked_prefill_size=chunk)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))  # cache the prompt
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    for _ in range(2):
        res = llm.generate([prompt], params)[0]
        assert len(res["prompt_logprobs"]) == len(prompt) - 1
        assert max(abs(a - b) for a, b in zip(res["prompt_logprobs"], expected)) < 1e-4
        assert [list(d) for d in res["prompt_top_logprobs"]] == top2
        assert res["cached_tokens"] == 0
    assert_engine_clean(llm)
