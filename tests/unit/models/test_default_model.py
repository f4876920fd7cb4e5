"""The bundled default model (SmolLM2-135M-Instruct, Q4_1 GGUF) runs out of the box."""

from __future__ import annotations

import pytest
import torch
import transformers

from minisgl import LLM, SamplingParams
from minisgl.models.default_model import default_model_path
from minisgl.models.gguf_loader import gguf_hf_config, iter_gguf_weights
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


@pytest.mark.slow  # batch invariance is tests/unit/scheduler/test_invariance.py's
def test_batch_of_chats_matches_single(llm: LLM) -> None:
    questions = ["Name a primary colour.", "What is 2 plus 2?", "Say hello in French."]
    params = SamplingParams(temperature=0, max_tokens=24)
    convs = [[{"role": "user", "content": q}] for q in questions]
    batched = [r["token_ids"] for r in llm.chat(convs, params)]
    single = [llm.chat(c, params)[0]["token_ids"] for c in convs]
    assert batched == single
    assert_engine_clean(llm)


@pytest.fixture(scope="module")
def hf_model() -> transformers.PreTrainedModel:
    """The independent reference: transformers dequantizes the same GGUF (loaded once: slow)."""
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def test_matches_hf_on_the_same_gguf(llm: LLM, hf_model: transformers.PreTrainedModel) -> None:
    """transformers decodes greedily from the same GGUF: the same tokens."""
    ids = llm.apply_chat_template([{"role": "user", "content": "Write a short poem about rain."}])
    ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, pad_token_id=2)
    ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    expected = ref[0, len(ids) :].tolist()
    assert ours["token_ids"][: len(expected)] == expected


def test_default_model_weights_match_transformers(hf_model: transformers.PreTrainedModel) -> None:
    transformers_state = hf_model.state_dict()
    seen: set[str] = set()
    for name, tensor in iter_gguf_weights(default_model_path()):
        assert name not in seen
        seen.add(name)
        ref = transformers_state[name]
        assert tensor.shape == ref.shape, name
        # Both sides run gguf's dequantizer on the same bytes, so expect bit-identical values
        # (torch.equal is also far cheaper than assert_close on 135M parameters).
        assert torch.equal(tensor, ref), f"{name}: max diff {(tensor - ref).abs().max()}"
    # Tied embeddings: the GGUF has no output.weight, transformers shares embed_tokens.
    assert seen == transformers_state.keys() - {"lm_head.weight"}
    assert len(seen) == 1 + 30 * 9 + 1


def test_default_model_config_matches_transformers(hf_model: transformers.PreTrainedModel) -> None:
    ours = gguf_hf_config(default_model_path())
    ref = hf_model.config
    for key in (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert ours[key] == getattr(ref, key), key
    assert ours["rope_theta"] == ref.rope_parameters["rope_theta"] == 100000.0
    assert ours["rope_scaling"] is None
    assert ours["architectures"] == ["LlamaForCausalLM"]
    assert ours["tie_word_embeddings"] is True
    assert (ours["bos_token_id"], ours["eos_token_id"]) == (1, 2)  # <|im_start|>, <|im_end|>
    assert ours["torch_dtype"] == "bfloat16"
