"""Shared test helpers: tiny random-weight Hugging Face models built on the fly."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

TINY_BASE: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def make_tiny_model(
    path: Path, arch: str = "llama", seed: int = 0, init_std: float = 0.08, **overrides: Any
) -> Path:
    """Save a random-weight float32 model of the given family to ``path`` (safetensors);
    a larger ``init_std`` gives more peaked next-token distributions."""
    import transformers as tf

    classes = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
    }
    cfg_cls, model_cls = classes[arch]
    kwargs = dict(TINY_BASE)
    if arch in ("qwen3", "qwen3_moe"):
        kwargs["head_dim"] = 32
    if arch == "qwen3_moe":
        # Layer 0 dense, layer 1 sparse: both MLP kinds in one model.
        kwargs.update(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            mlp_only_layers=[0],
            norm_topk_prob=True,
        )
    if arch == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(overrides)
    cfg = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(cfg).float()
    # Larger-than-default init so logits are peaked and greedy ties are implausible.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, init_std)
            else:
                p.uniform_(0.8, 1.2)
    model.save_pretrained(path, safe_serialization=True)
    save_tiny_tokenizer(path, cfg.vocab_size)
    return path


def save_tiny_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer whose words are t3..t{V-1} plus <unk>, <s>, </s>: every id decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = {0: "<unk>", 1: "<s>", 2: "</s>"}
    vocab = {names.get(i, f"t{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<unk>",
    )
    fast.chat_template = (
        "{% for m in messages %}t3 {{ m['content'] }} t4 {% endfor %}"
        "{% if add_generation_prompt %}t5{% endif %}"
    )
    fast.save_pretrained(path)


def hf_greedy(
    path: Path, prompts: list[list[int]], max_new_tokens: int
) -> tuple[list[list[int]], list[list[float]]]:
    """Reference: Hugging Face transformers greedy tokens and chosen-token logprobs, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs, lps = [], []
    for ids in prompts:
        inp = torch.tensor([ids])
        with torch.no_grad():
            g = model.generate(
                inp,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                output_logits=True,
                pad_token_id=0,
                eos_token_id=None,
            )
        toks = g.sequences[0, len(ids) :].tolist()
        logits = torch.stack(g.logits, 0)[:, 0].float()
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(toks)[:, None])[:, 0].tolist()
        outs.append(toks)
        lps.append(lp)
    return outs, lps


def perturbed_copy(src: Path, dst: Path, scale: float, seed: int = 1) -> Path:
    """A copy of the model at ``src`` with Gaussian noise of std ``scale`` added to every
    weight but the norms: a draft model that agrees with the original most of the time."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(seed)
    weights = load_file(str(src / "model.safetensors"))
    for name, w in weights.items():
        if "norm" not in name:
            weights[name] = w + scale * torch.randn(w.shape, generator=gen)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def shared_prefix_workload(
    seed: int, requests: int, system_len: int, max_tail: int, max_tokens: int
) -> tuple[list[list[int]], list[Any]]:
    """Greedy requests, every other one behind one shared system prompt (radix-cache hits),
    with random tails of 1..max_tail ids and 4..max_tokens output tokens (ignore_eos)."""
    from minisgl import SamplingParams

    rng = random.Random(seed)
    system = [rng.randrange(3, 256) for _ in range(system_len)]
    prompts = []
    for i in range(requests):
        tail = [rng.randrange(3, 256) for _ in range(rng.randint(1, max_tail))]
        prompts.append(system + tail if i % 2 else tail)
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(4, max_tokens), ignore_eos=True)
        for _ in prompts
    ]
    return prompts, params


def abort_mix_workload(
    seed: int = 0, long_tokens: tuple[int, int] = (16, 32)
) -> list[tuple[list[int], Any, int]]:
    """(prompt, params, wave) for 18 greedy requests: long decodes of ``long_tokens`` (a
    range; half of them behind a shared prefix) alternating with one short prompt repeated, max_tokens 1 or 2 (finished in
    their first steps); wave w joins after step (0, 2, 5)[w]."""
    from minisgl import SamplingParams

    rng = random.Random(seed)
    shared = [rng.randrange(3, 256) for _ in range(40)]
    short = [17, 18, 19, 20, 21, 22]
    out = []
    for i in range(18):
        if i % 2 == 0:
            tail = [rng.randrange(3, 256) for _ in range(rng.randint(5, 120))]
            prompt, n = (shared if i % 4 == 0 else []) + tail, rng.randint(*long_tokens)
        else:
            prompt, n = short, 1 + (i // 2) % 2
        out.append((prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), i // 6))
    return out


# Each victim (every third request) is aborted once it is unfinished and this holds; "last"
# (num_generated reaches max_tokens) is only reachable under overlap scheduling, with the
# last token in flight: the finishing step (SGLang PR #111: freed twice).
ABORT_AT: dict[int, int | str] = {2: 0, 5: "last", 8: 3, 11: 1, 14: "last", 17: "last"}


def run_abort_mix(
    llm: Any,
    before_abort: Callable[[Any], None] | None = None,
    long_tokens: tuple[int, int] = (16, 32),
) -> tuple[list[Any], set[int]]:
    """Drive ``llm``'s scheduler through ``abort_mix_workload`` step by step, aborting the
    victims of ``ABORT_AT`` between steps, until idle. Returns the requests and the indices
    that were aborted (``before_abort`` sees each victim just before)."""
    sched = llm.scheduler
    work = abort_mix_workload(long_tokens=long_tokens)
    joins = {0: 0, 1: 2, 2: 5}
    reqs: list[Any] = [None] * len(work)
    aborted: set[int] = set()
    for step in range(1000):
        for i, (prompt, params, wave) in enumerate(work):
            if joins[wave] == step:
                reqs[i] = sched.add_request(prompt, params)
        for i, at in ABORT_AT.items():
            req = reqs[i]
            if req is None or req.finished or i in aborted:
                continue
            limit = req.params.max_tokens if at == "last" else at
            if req.num_generated >= limit:
                if before_abort is not None:
                    before_abort(req)
                assert sched.abort(req.uid) is req
                assert req.finished and req.finish_reason == "abort"
                assert sched.abort(req.uid) is None  # freed once: a second abort finds nothing
                aborted.add(i)
        if step > max(joins.values()) and not sched.has_work:
            break
        sched.step()
    else:
        raise AssertionError("the scheduler never went idle")
    sched.drain()
    return reqs, aborted


def check_abort_mix(reqs: list[Any], aborted: set[int], ref: list[Any], overlap: bool) -> None:
    """Survivors' tokens equal the reference run's; an aborted request kept a prefix of them.
    Under overlap every victim was aborted, a finishing-step victim with its in-flight last
    sample dropped; without it the finishing-step victims completed."""
    last = {i for i, at in ABORT_AT.items() if at == "last"}
    assert aborted == (set(ABORT_AT) if overlap else set(ABORT_AT) - last)
    for i, (req, want) in enumerate(zip(reqs, ref)):
        if i in aborted:
            assert req.finish_reason == "abort", i
            assert req.output_ids == want.output_ids[: len(req.output_ids)], i
            if i in last:
                assert len(req.output_ids) == req.params.max_tokens - 1, i
        else:
            assert req.finish_reason == "length", (i, req.finish_reason)
            assert req.output_ids == want.output_ids, i


# Three worked turns that teach the default model (SmolLM2) to think in <think>...</think>
# before its JSON: a greedy reply to ``thinking_chat(city)`` then thinks, and ends its
# thinking, on its own (structured output that waits for the thinking, grammar_after).
THINKING_SHOTS = [("Rome", "Rome is big"), ("Oslo", "Oslo is cold"), ("Lima", "Lima is warm")]


def thinking_chat(city: str = "Paris") -> list[dict[str, str]]:
    """The worked turns, then the question about ``city``."""
    turns = [
        turn
        for shot, thought in THINKING_SHOTS
        for turn in (
            {"role": "user", "content": f"Describe {shot} as JSON."},
            {"role": "assistant", "content": f'<think>{thought}</think>\n\n{{"city": "{shot}"}}'},
        )
    ]
    return turns + [{"role": "user", "content": f"Describe {city} as JSON."}]
