"""Shared test helpers: tiny random-weight Hugging Face models built on the fly, the
clean-engine check every engine test ends with, and references the engine is compared with
(Hugging Face greedy decoding, where a stop regex first matches). Workloads and scheduler
drivers are in tests/workloads.py."""

from __future__ import annotations

import re
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


def make_fp8_robust_llama(path: Path, **overrides: object) -> Path:
    """A tiny Llama whose greedy path survives fp8 K/V: small weights (init_std 0.03) and
    the embeddings scaled by 4. Measured on 4 prompts x 12 tokens (CPU, fp32): fp8 e4m3 and
    e5m2 both match HF on all of them (prompt logprobs within 0.005 / 0.009 of the fp32
    cache), while K/V scaled by 1.25 already flips tokens (logprobs off by 0.05), zeroed K/V
    by 0.2 and random K/V by 0.5: attention matters in this model. Larger init_std (more
    peaked logits, but sharper attention too) flipped greedy tokens under fp8 within a few
    steps."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_model(path, "llama", init_std=0.03, **overrides)
    weights = load_file(str(path / "model.safetensors"))
    weights["model.embed_tokens.weight"] *= 4
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
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


class TinyModels(dict[str, Path]):
    """The session's tiny models, each built once and shared read-only: ``models["qwen3"]``
    is the family's default model (TINY_BASE), ``models.build(arch, **options)`` a variant
    (the same arguments give the same directory), ``models.perturbed(path, scale)`` a near
    copy of one of them (a draft model)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, arch: str) -> Path:
        return self.build(arch)

    def build(self, arch: str, **options: Any) -> Path:
        """``make_tiny_model(path, arch, **options)``, built the first time it is asked for."""
        key = arch if not options else f"{arch}{sorted(options.items())!r}"
        if key not in self:
            name = arch if not options else f"{arch}-{_digest(key)}"
            self[key] = make_tiny_model(self.root / name, arch, **options)
        return self[key]

    def perturbed(self, src: Path, scale: float, seed: int = 1) -> Path:
        """``perturbed_copy`` of the model at ``src``, made the first time it is asked for."""
        key = f"{src}~{scale!r}~{seed}"
        if key not in self:
            self[key] = perturbed_copy(
                src, self.root / f"{src.name}-near-{_digest(key)}", scale, seed
            )
        return self[key]


def _digest(text: str) -> str:
    import hashlib

    return hashlib.sha1(text.encode()).hexdigest()[:10]


def assert_engine_clean(llm: object) -> None:
    """After a run: integrity holds, nothing is running, every page is free or evictable."""
    sched = llm.scheduler  # type: ignore[attr-defined]
    sched.check_integrity()
    assert not sched.running and not sched.waiting
    kv = sched.kv
    assert kv.allocator.num_free_pages + kv.cache.evictable_pages == kv.allocator.num_pages
    assert kv.cache.protected_pages == 0


def first_regex_stop(llm: Any, ids: list[int], pattern: str) -> tuple[list[int], str]:
    """Independently of the matcher: the shortest output whose text holds a match (stdlib re,
    token by token), and that text cut at the match."""
    for k in range(1, len(ids) + 1):
        text = llm.tokenizer.decode(ids[:k], skip_special_tokens=True)
        m = re.search(pattern, text)
        if m is not None:
            return ids[:k], text[: m.start()]
    raise AssertionError(f"{pattern!r} never matches")


def teacher_forced_agreement(
    llm: Any, prompt: list[int], ref: list[int], ref_lp: list[float]
) -> tuple[float, float]:
    """Teacher-forced greedy decoding: from ``prompt`` + ``ref``[:pos], generate until the
    first token that differs from ``ref``, count it, restart after it. (top-1 agreement,
    mean |chosen-token logprob difference| where they agree)."""
    from minisgl import SamplingParams

    agree, pos, diffs = 0, 0, []
    while pos < len(ref) and pos - agree <= len(ref) // 20:
        params = SamplingParams(
            temperature=0, max_tokens=len(ref) - pos, ignore_eos=True, logprobs=True
        )
        out = llm.generate([prompt + ref[:pos]], params, use_tqdm=False)[0]
        same = next(
            (i for i, (a, b) in enumerate(zip(out["token_ids"], ref[pos:])) if a != b),
            len(out["token_ids"]),
        )
        diffs += [abs(a - b) for a, b in zip(out["logprobs"][:same], ref_lp[pos : pos + same])]
        agree, pos = agree + same, pos + same + 1
    return agree / len(ref), sum(diffs) / max(len(diffs), 1)
