"""The bundled default model (SmolLM2-135M-Instruct, Q4_1 GGUF) runs out of the box."""

from __future__ import annotations

import pytest

from minisgl import LLM, SamplingParams
from tests.helpers import assert_engine_clean


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


def test_answers_paris(llm: LLM) -> None:
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=40),
    )[0]
    assert "Paris" in out["text"]
    assert out["finish_reason"] == "stop"  # ends on <|im_end|>, which is not in the text
    assert "<|im_end|>" not in out["text"]
    assert_engine_clean(llm)


def test_batch_of_chats_matches_single(llm: LLM) -> None:
    questions = ["Name a primary colour.", "What is 2 plus 2?", "Say hello in French."]
    params = SamplingParams(temperature=0, max_tokens=24)
    convs = [[{"role": "user", "content": q}] for q in questions]
    batched = [r["token_ids"] for r in llm.chat(convs, params)]
    single = [llm.chat(c, params)[0]["token_ids"] for c in convs]
    assert batched == single
    assert_engine_clean(llm)


def test_matches_hf_on_the_same_gguf(llm: LLM) -> None:
    """Independent reference: transformers dequantizes the same GGUF and decodes greedily."""
    import torch
    from transformers import AutoModelForCausalLM

    from minisgl.models.default_model import default_model_path

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ids = llm.apply_chat_template([{"role": "user", "content": "Write a short poem about rain."}])
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, pad_token_id=2)
    ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    expected = ref[0, len(ids) :].tolist()
    assert ours["token_ids"][: len(expected)] == expected
