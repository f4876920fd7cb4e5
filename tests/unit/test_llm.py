"""The offline API: batching, sampling controls, stop conditions and input validation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams
from tests.helpers import assert_engine_clean

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models: dict[str, Path]) -> LLM:
    return LLM(str(tiny_models["qwen3"]))


@pytest.mark.parametrize("page_size", [1, 16])
def test_batch_invariance(tiny_models: dict[str, Path], page_size: int) -> None:
    llm = LLM(str(tiny_models["llama"]), page_size=page_size, cache="naive")
    prompts = [[9, 8, 7, 6], list(range(20, 57)), [1, 2], list(range(100, 119)), [42] * 9]
    alone = [llm.generate([p], GREEDY)[0]["token_ids"] for p in prompts]
    together = [r["token_ids"] for r in llm.generate(prompts, GREEDY)]
    assert alone == together
    assert_engine_clean(llm)


def test_token_ids_and_text_prompts(llm: LLM) -> None:
    ids = llm.encode("t5 t6 t7")
    assert ids == [5, 6, 7]
    a = llm.generate("t5 t6 t7", GREEDY)[0]
    b = llm.generate([[5, 6, 7]], GREEDY)[0]
    assert a["token_ids"] == b["token_ids"]
    assert a["text"] == " ".join(f"t{t}" for t in a["token_ids"] if t not in (0, 1, 2))
    assert a["prompt_tokens"] == 3 and a["completion_tokens"] == 20


def test_results_in_input_order_with_per_prompt_params(llm: LLM) -> None:
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 11, 7)]
    out = llm.generate(prompts, params)
    assert [len(r["token_ids"]) for r in out] == [3, 11, 7]
    assert [r["finish_reason"] for r in out] == ["length"] * 3


def test_seeded_sampling_is_reproducible_and_batch_independent(llm: LLM) -> None:
    p = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, max_tokens=16, ignore_eos=True, seed=1234
    )
    alone = llm.generate([[5, 6, 7]], p)[0]["token_ids"]
    again = llm.generate([[5, 6, 7]], p)[0]["token_ids"]
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    mixed = llm.generate([[1, 2, 3], [5, 6, 7], [9, 9]], [others, p, others])[1]["token_ids"]
    assert alone == again == mixed
    other_seed = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, max_tokens=16, ignore_eos=True, seed=99
    )
    assert llm.generate([[5, 6, 7]], other_seed)[0]["token_ids"] != alone


def test_max_tokens_exact_and_stop_token_ids(llm: LLM) -> None:
    full = llm.generate([[5, 6, 7]], GREEDY)[0]["token_ids"]
    for n in (1, 2, 13):
        r = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[
            0
        ]
        assert r["token_ids"] == full[:n] and r["finish_reason"] == "length"
    stop_tok = full[5]
    first = full.index(stop_tok)
    r = llm.generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok])
    )[0]
    assert r["token_ids"] == full[: first + 1]
    assert r["finish_reason"] == "stop" and r["matched_stop"] == stop_tok


def test_stop_strings_are_exact_and_excluded(llm: LLM) -> None:
    full = llm.generate([[5, 6, 7]], GREEDY)[0]
    words = full["text"].split(" ")
    stop = f"{words[4]} {words[5]}"  # spans two tokens
    r = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20, stop=[stop, "zzz"]))[
        0
    ]
    assert r["finish_reason"] == "stop" and r["matched_stop"] == stop
    assert stop not in r["text"]
    assert full["text"].startswith(r["text"])
    assert r["text"] == full["text"][: full["text"].find(stop)]
    assert len(r["token_ids"]) == full["text"][: full["text"].find(stop)].count(" ") + 2


def test_eos_stops_unless_ignored(tiny_models: dict[str, Path]) -> None:
    llm = LLM(str(tiny_models["qwen3"]))
    full = llm.generate([[5, 6, 7]], GREEDY)[0]["token_ids"]
    # Treat a token the model emits as EOS by swapping the engine's EOS ids.
    llm.scheduler.stop_checker.eos_ids = frozenset({full[3]})
    r = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20))[0]
    assert r["token_ids"] == full[: full.index(full[3]) + 1] and r["finish_reason"] == "stop"
    r = llm.generate([[5, 6, 7]], GREEDY)[0]
    assert r["token_ids"] == full


def test_logprobs_and_top_logprobs(llm: LLM) -> None:
    r = llm.generate(
        [[5, 6, 7]],
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=True, top_logprobs=3),
    )[0]
    assert len(r["logprobs"]) == 5 and len(r["top_logprobs"]) == 5
    for tok, lp, top in zip(r["token_ids"], r["logprobs"], r["top_logprobs"]):
        assert len(top) == 3
        best = max(top, key=top.get)
        assert best == tok and abs(top[tok] - lp) < 1e-6  # greedy picks the top-1


def test_logits_stay_in_model_dtype_and_logprobs_use_their_float32(
    tiny_models: dict[str, Path],
) -> None:
    """A bf16 model hands back bf16 logits (no float32 copy); the chosen tokens, logprobs and
    prompt logprobs are those of the exact float32 upcast."""
    llm = LLM(str(tiny_models["qwen3"]), dtype="bfloat16")
    seen: list[torch.Tensor] = []
    hook = llm.engine.model.register_forward_hook(lambda _m, _i, out: seen.append(out.clone()))
    prompt = [5, 6, 7, 8, 9, 10]
    params = SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, logprobs=True, prompt_logprobs=0
    )
    try:
        res = llm.generate([prompt], params)[0]
    finally:
        hook.remove()
    assert seen and all(x.dtype == torch.bfloat16 for x in seen)
    # The prefill's rows: the sampling row, then the prompt positions that score prompt[1:].
    prefill = seen[0]
    assert prefill.shape[0] == len(prompt)
    prompt_lp = torch.log_softmax(prefill[1:].float(), -1)
    want = prompt_lp.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(res["prompt_logprobs"]), want)
    rows = [prefill[:1]] + seen[1:4]  # then one decode row per step
    for tok, lp, logits in zip(res["token_ids"], res["logprobs"], rows, strict=True):
        assert tok == int(logits.argmax())
        torch.testing.assert_close(lp, float(torch.log_softmax(logits.float(), -1)[0, tok]))
    assert_engine_clean(llm)


def test_penalties_change_output(llm: LLM) -> None:
    base = llm.generate(
        [[5, 5, 5, 5]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    )[0]["token_ids"]
    rep = llm.generate(
        [[5, 5, 5, 5]],
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, presence_penalty=2.0),
    )[0]["token_ids"]
    assert len(set(rep)) >= len(set(base))
    assert rep != base or len(set(base)) == len(base)


def test_chat_template(llm: LLM) -> None:
    msgs = [{"role": "user", "content": "t9 t10"}]
    ids = llm.apply_chat_template(msgs)
    assert ids == [3, 9, 10, 4, 5]
    r = llm.chat(msgs, GREEDY)[0]
    assert r["token_ids"] == llm.generate([ids], GREEDY)[0]["token_ids"]


def test_chat_template_options(llm: LLM, tmp_path: Path) -> None:
    """chat_template_kwargs reach the template (Qwen3's enable_thinking, here a stand-in);
    continue_final_message leaves the assistant's message open (no closing tag, no
    generation prompt); bad uses are ValueErrors naming the option."""
    from minisgl.tokenizer import render_chat
    from tests.helpers import save_tiny_tokenizer

    save_tiny_tokenizer(tmp_path, 64)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    tok.chat_template = (
        "{% for m in messages %}t3 {{ m['content'] }}"
        "{% if not (loop.last and continue_final_message) %} t4{% endif %} {% endfor %}"
        "{% if add_generation_prompt %}t5{% endif %}"
        "{% if enable_thinking is defined and not enable_thinking %} t6{% endif %}"
    )
    msgs = [{"role": "user", "content": "t9"}]
    assert render_chat(tok, msgs) == [3, 9, 4, 5]
    assert render_chat(tok, msgs, {"enable_thinking": False}) == [3, 9, 4, 5, 6]
    draft = [*msgs, {"role": "assistant", "content": "t10 t11"}]
    assert render_chat(tok, draft, continue_final_message=True) == [3, 9, 4, 3, 10, 11]
    with pytest.raises(ValueError, match="continue_final_message"):
        render_chat(tok, msgs, continue_final_message=True)
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        render_chat(tok, msgs, {"tokenize": False})
    # The offline API passes them through (the fixture's template ignores enable_thinking).
    ids = llm.apply_chat_template(draft, {"enable_thinking": False}, continue_final_message=True)
    # transformers cuts the rendering after the final message's text, closing tag included.
    assert ids == [3, 9, 4, 3, 10, 11]
    assert llm.chat(msgs, GREEDY, add_generation_prompt=False)[0]["prompt_tokens"] == 3
    # tools reach the template (here it names each function as a word).
    tok.chat_template = "{% for t in tools or [] %}{{ t['function']['name'] }} {% endfor %}t5"
    tools = [{"type": "function", "function": {"name": "t7"}}]
    assert render_chat(tok, msgs, tools=tools) == [7, 5]
    assert render_chat(tok, msgs) == [5]


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
    ],
)
def test_bad_sampling_params(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_lose_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)
    too_long = [5] * (llm.engine.context_length + 3)
    with pytest.raises(ValueError, match="context length"):
        llm.generate([[5, 6], too_long], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[5, 10**6]], GREEDY)
    # Nothing was queued by the failed calls, and the engine still works.
    assert not llm.scheduler.waiting and not llm.scheduler.running
    assert len(llm.generate([[5, 6]], GREEDY)[0]["token_ids"]) == 20
    assert_engine_clean(llm)


def test_missing_model_path() -> None:
    with pytest.raises(ValueError, match="does-not-exist"):
        LLM("/nonexistent/does-not-exist")


def test_unknown_option() -> None:
    with pytest.raises(ValueError, match="no_such_flag"):
        LLM(None, no_such_flag=1)


def test_sampler_warm_up_runs_every_kind_and_leaves_the_engine_clean(llm: LLM) -> None:
    # On CUDA the engine runs this at startup so no sampler kernel compiles mid-run; here
    # it checks the warm-up's own logic (batches it builds, LM-head width) with the eager
    # sampler, and that it disturbs nothing.
    before = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6))
    llm.engine._warm_up_sampler()
    after = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6))
    assert before[0]["token_ids"] == after[0]["token_ids"]
    assert_engine_clean(llm)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"cuda_graph_max_tokens": -1}, "cuda_graph_max_tokens"),
        ({"chunked_prefill_size": 0}, "chunked_prefill_size"),
    ],
)
def test_bad_engine_options_name_the_field(kwargs: dict, field: str) -> None:
    from minisgl.config import EngineConfig

    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)
    # None (auto) and 0 (graphs off for prefill/mixed steps) are valid.
    EngineConfig(cuda_graph_max_tokens=0, chunked_prefill_size=None)


def test_no_memory_for_the_kv_cache_is_a_clear_error(tiny_models: dict[str, Path]) -> None:
    """A budget too small for the pool's 2-page minimum fails at startup, naming the knob.
    (It used to give a 2-page pool and a context of one token: every prompt "too long". Seen
    on the H200 when another engine in the process still held the GPU's memory.)"""
    with pytest.raises(ValueError, match="no memory left for the KV cache.*cpu_kv_cache_gb"):
        LLM(str(tiny_models["llama"]), cpu_kv_cache_gb=1e-7)


def test_close_frees_the_engine(tiny_models: dict[str, Path]) -> None:
    """close() lets the engine go (on CUDA its pool is then free for the next LLM: seen on
    the H200, where a second engine in the process found no memory left), and is final."""
    import weakref

    llm = LLM(str(tiny_models["llama"]))
    engine = weakref.ref(llm.engine)
    assert len(llm.generate([[5, 6, 7]], GREEDY)[0]["token_ids"]) == 20
    llm.close()
    assert engine() is None, "something still holds the closed engine"
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[5, 6, 7]], GREEDY)
    llm.close()  # idempotent
