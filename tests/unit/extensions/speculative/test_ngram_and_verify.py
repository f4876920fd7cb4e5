"""Speculative decoding: n-gram drafting and exact rejection-sampling verification."""

from __future__ import annotations

import torch

from minisgl.extensions.speculative.ngram import NgramDrafter
from minisgl.extensions.speculative.verify import verify, verify_greedy
from tests.helpers import TinyModels


def test_ngram_proposes_the_latest_continuation() -> None:
    d = NgramDrafter(max_n=3)
    d.extend([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3])
    assert d.propose(2) == [7, 8]  # latest earlier "1 2 3" was followed by 7 8
    assert NgramDrafter().propose(3) == []
    e = NgramDrafter(max_n=2)
    e.extend([5, 6, 7, 6])
    assert e.propose(3) == [7, 6]  # falls back to the 1-gram "6"


def test_greedy_keeps_exactly_the_matching_prefix() -> None:
    vocab = 6
    argmax = torch.tensor([[2, 4, 1, 3]])
    probs = torch.nn.functional.one_hot(argmax, vocab).float()  # [1, 4, V]
    seeds, steps = torch.tensor([7]), torch.tensor([0])
    toks, n = verify(probs, torch.tensor([[2, 4, 5]]), None, seeds, steps)
    assert n.item() == 3 and toks[0, :3].tolist() == [2, 4, 1]  # third draft wrong: corrected
    toks, n = verify(probs, torch.tensor([[2, 4, 1]]), None, seeds, steps)
    assert n.item() == 4 and toks[0].tolist() == [2, 4, 1, 3]  # all kept plus the bonus
    toks, n = verify(probs, torch.tensor([[2, -1, -1]]), None, seeds, steps)
    assert n.item() == 2 and toks[0, :2].tolist() == [2, 4]  # short draft, then bonus


def test_greedy_fast_path_equals_rejection_sampling() -> None:
    """verify_greedy (what the engine runs for all-greedy batches) == verify on one-hot p."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 4, 6, generator=gen)
    best = logits.argmax(-1)
    # Drafts that follow the argmax for a random number of positions, then diverge or pad.
    keep = torch.randint(0, 4, (64,), generator=gen)
    drafts = torch.where(torch.arange(3) < keep[:, None], best[:, :3], (best[:, :3] + 1) % 6)
    drafts[::5, 2] = -1
    probs = torch.nn.functional.one_hot(best, 6).float()
    seeds, steps = torch.arange(64), torch.zeros(64, dtype=torch.long)
    toks, num = verify(probs, drafts, None, seeds, steps)
    fast, fast_num = verify_greedy(logits, drafts)
    assert torch.equal(num, fast_num)
    for i in range(64):
        assert toks[i, : num[i]].tolist() == fast[i, : num[i]].tolist()


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_emitted_tokens_follow_the_target_distribution() -> None:
    """First and second emitted tokens are distributed as the target's, whatever the draft."""
    torch.manual_seed(0)
    vocab, n = 5, 40000
    p0 = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05])
    p1 = torch.tensor([0.3, 0.05, 0.15, 0.3, 0.2])
    target = torch.stack([p0, p1, p0]).expand(n, 3, vocab).contiguous()
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 13
    steps = torch.zeros(n, dtype=torch.int64)
    # Deterministic draft (n-gram): always proposes tokens 1 then 3.
    drafts = torch.tensor([1, 3]).expand(n, 2).contiguous()
    toks, num = verify(target, drafts, None, seeds, steps)
    first = torch.bincount(toks[:, 0], minlength=vocab).float()
    assert _chi2(first, p0) < 25.0  # 4 d.o.f.: p < 1e-4 for a correct sampler
    # Second token, among rows that kept the first draft (token 1): distributed as p1.
    kept = num >= 2
    second = torch.bincount(toks[kept, 1], minlength=vocab).float()
    assert _chi2(second, p1) < 25.0
    # A stochastic draft (a draft model's q): the first token is still distributed as p0.
    q = torch.tensor([0.5, 0.1, 0.1, 0.2, 0.1])
    draft_tok = torch.multinomial(q, n, replacement=True)[:, None]
    qs = q.expand(n, 1, vocab).contiguous()
    toks, _ = verify(target[:, :2].contiguous(), draft_tok, qs, seeds, steps)
    first = torch.bincount(toks[:, 0], minlength=vocab).float()
    assert _chi2(first, p0) < 25.0


def test_same_seed_same_tokens_regardless_of_batch() -> None:
    vocab = 7
    probs = torch.softmax(torch.randn(3, 4, vocab, generator=torch.Generator().manual_seed(1)), -1)
    drafts = torch.tensor([[1, 2, 3], [0, 0, 0], [4, 5, 6]])
    seeds, steps = torch.tensor([11, 22, 33]), torch.tensor([5, 6, 7])
    toks, num = verify(probs, drafts, None, seeds, steps)
    alone, n_alone = verify(probs[1:2], drafts[1:2], None, seeds[1:2], steps[1:2])
    assert n_alone.item() == num[1].item()
    assert toks[1, : num[1]].tolist() == alone[0, : n_alone[0]].tolist()


def test_ngram_speculation_keeps_greedy_outputs(tiny_models: dict) -> None:  # type: ignore[type-arg]
    """Speculation on vs off: identical greedy tokens, with drafts actually accepted."""
    from minisgl import LLM, SamplingParams
    from tests.helpers import assert_engine_clean

    prompts = [[5, 6, 7, 8] * 6, list(range(40, 70)), [9, 9, 9], [100, 101, 102, 100, 101]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 17, 25, 9)]
    path = str(tiny_models["llama"])
    ref = [r["token_ids"] for r in LLM(path).generate(prompts, params)]
    for page_size in (1, 4):
        llm = LLM(path, speculative_algorithm="ngram", speculative_num_steps=3, page_size=page_size)
        out = [r["token_ids"] for r in llm.generate(prompts, params)]
        assert out == ref
        assert llm.scheduler.totals.get("spec_accepted_tokens", 0) > 0
        assert_engine_clean(llm)
    # Sampled requests are verified by rejection sampling: same seed, same tokens.
    llm = LLM(path, speculative_algorithm="ngram")
    sp = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True, seed=3)
    a = llm.generate([prompts[0]], sp)[0]["token_ids"]
    b = llm.generate([prompts[0], prompts[1]], [sp, sp])[0]["token_ids"]
    assert a == b and len(a) == 20
    assert_engine_clean(llm)


def test_draft_model_sampling_follows_the_target(tiny_models: TinyModels) -> None:
    """End to end with a draft model of another architecture (q far from p): the first three
    tokens are jointly distributed as the target's. Tokens 2 and 3 are the two verified
    draft positions of one step, token 4 its bonus, so this checks the draft's recorded q,
    its noise being independent of the verifier's, and the residual resampling."""
    from transformers import AutoModelForCausalLM

    from minisgl import LLM, SamplingParams

    vocab, prompt, n = 32, [10, 20, 30, 4], 1500
    # Peaked (init_std 0.2) over a small vocabulary: the joint distribution is computable.
    target = tiny_models.build("llama", seed=3, init_std=0.2, vocab_size=vocab)
    draft = tiny_models.build("qwen3", seed=4, init_std=0.2, vocab_size=vocab)
    llm = LLM(str(target), speculative_draft_model=str(draft), speculative_num_steps=2)
    params = [
        SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=s) for s in range(n)
    ]
    outs = [r["token_ids"] for r in llm.generate([prompt] * n, params, use_tqdm=False)]
    totals = llm.scheduler.totals
    assert 0 < totals["spec_accepted_tokens"] < totals["spec_draft_tokens"]  # both branches taken
    # Exact joint distribution of tokens 1..3 under the target (HF forwards, fp32).
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ids = torch.arange(vocab)
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
        ctx2 = torch.cat([torch.tensor(prompt).expand(vocab, -1), ids[:, None]], 1)
        p2 = torch.softmax(model(ctx2).logits[:, -1], -1)  # [t1, t2]
        pairs = torch.cartesian_prod(ids, ids)
        ctx3 = torch.cat([torch.tensor(prompt).expand(vocab * vocab, -1), pairs], 1)
        p3 = torch.softmax(model(ctx3).logits[:, -1], -1).view(vocab, vocab, vocab)
    joint = (p1[:, None, None] * p2[:, :, None] * p3).flatten()
    cells = torch.tensor([(a * vocab + b) * vocab + c for a, b, c, _ in outs])
    counts = torch.bincount(cells, minlength=vocab**3).float()
    # Cells expected fewer than 5 times are pooled into one.
    big = joint * n >= 5
    counts = torch.cat([counts[big], counts[~big].sum()[None]])
    probs = torch.cat([joint[big], joint[~big].sum()[None]])
    dof = len(probs) - 1
    assert _chi2(counts, probs) < dof + 5 * (2 * dof) ** 0.5, dof  # ~p < 1e-5
