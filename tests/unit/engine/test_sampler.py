from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.engine.noise import mix64, uniform_noise
from minisgl.engine.sampler import PenaltyState, SampleOutput, Sampler, SamplingBatch
from minisgl.sampling_params import SamplingParams

SAMPLER = Sampler()
# Seeds are fixed, so every statistical test below is deterministic; the threshold only
# has to be loose enough that a correct sampler passes and a biased one does not.
P_MIN = 1e-4


def run(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int] | None = None,
    steps: list[int] | None = None,
    state: PenaltyState | None = None,
    rows: torch.Tensor | None = None,
) -> SampleOutput:
    n = len(params)
    batch = SamplingBatch.build(
        params, seeds if seeds is not None else list(range(n)), steps or [0] * n, "cpu"
    )
    return SAMPLER.sample(logits, batch, state, rows)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Upper tail of the chi-square statistic, with df = (#cells - 1)."""
    expected = probs.double() * counts.sum()
    stat = ((counts.double() - expected) ** 2 / expected).sum()
    df = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2.0))


def draw_counts(logits: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """n draws of one row, vectorised as n rows with distinct seeds."""
    out = run(
        logits.expand(n, -1).contiguous(), [params] * n, seeds=list(range(10_000, 10_000 + n))
    )
    return torch.bincount(out.next_tokens, minlength=logits.shape[-1])


# --- counter-based noise ---------------------------------------------------------------


def test_mix64_matches_python_splitmix64() -> None:
    mask = (1 << 64) - 1

    def ref(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    gen = torch.Generator().manual_seed(0)
    xs = torch.randint(-(2**63), 2**63 - 1, (4096,), dtype=torch.int64, generator=gen)
    got = mix64(xs).tolist()
    assert all((g & mask) == ref(x & mask) for g, x in zip(got, xs.tolist(), strict=True))


def test_uniform_noise_is_uniform_and_pure() -> None:
    seeds = torch.arange(50, dtype=torch.int64)
    steps = torch.arange(50, dtype=torch.int64) * 7
    u = uniform_noise(seeds, steps, torch.arange(4000))
    assert 0.0 < float(u.min()) and float(u.max()) <= 1.0
    counts = torch.histc(u, bins=100, min=0.0, max=1.0)
    assert chi2_pvalue(counts, torch.full((100,), 0.01)) > P_MIN
    # A pure function of (seed, step, id): recomputing any subset gives the same values.
    again = uniform_noise(seeds[7:8], steps[7:8], torch.arange(4000))
    assert torch.equal(again[0], u[7])
    # Neighbouring seeds / steps are not correlated.
    assert abs(float(torch.corrcoef(u[:2])[0, 1])) < 0.05


# --- greedy and logprobs -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = run(logits, [SamplingParams(temperature=0.0)] * 6)
    assert torch.equal(out.next_tokens, logits.argmax(-1))
    assert out.chosen_logprobs is None and out.top_logprobs is None
    # top_k == 1 is greedy too, and greedy rows stay argmax inside a sampled batch.
    mixed = [SamplingParams(top_k=1), SamplingParams(temperature=0.7)] * 3
    out = run(logits, mixed)
    assert torch.equal(out.next_tokens[0::2], logits[0::2].argmax(-1))


def test_logprobs_are_raw_log_softmax_and_top_k_sorted() -> None:
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    params = [
        SamplingParams(temperature=0.5, repetition_penalty=1.5, logprobs=True, top_logprobs=5),
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(temperature=1.3, top_k=10, top_logprobs=3),
        SamplingParams(),
    ]
    state = PenaltyState(4, 64, "cpu")
    for slot in range(4):
        state.reset_slot(slot, torch.tensor([1, 2, 3]))
    out = run(logits, params, state=state)
    ref = torch.log_softmax(logits, dim=-1)  # raw: no penalty, no temperature
    assert out.chosen_logprobs is not None
    assert out.top_logprobs is not None and out.top_logprob_ids is not None
    torch.testing.assert_close(out.chosen_logprobs, ref.gather(1, out.next_tokens[:, None])[:, 0])
    assert out.top_logprob_ids.shape == (4, 5)
    expected_vals, expected_ids = ref.sort(dim=-1, descending=True)
    assert torch.equal(out.top_logprob_ids, expected_ids[:, :5])
    torch.testing.assert_close(out.top_logprobs, expected_vals[:, :5])
    out = run(logits, [SamplingParams(temperature=0, logprobs=True)] * 4)
    assert out.top_logprobs is None and out.chosen_logprobs is not None


# --- reproducibility ---------------------------------------------------------------------


def test_same_seed_and_step_same_token_at_any_batch_position() -> None:
    vocab = 1000
    gen = torch.Generator().manual_seed(3)
    target = SamplingParams(temperature=0.9, top_k=50)
    others = [
        SamplingParams(temperature=1.0),  # top-k off: forces a full sort instead of topk
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.6, top_p=0.9),
        SamplingParams(temperature=1.2, min_p=0.05, top_k=5),
        SamplingParams(temperature=2.0, logprobs=True),
        SamplingParams(temperature=0.3, top_k=200, top_p=0.5),
        SamplingParams(temperature=1.0, top_k=3),
    ]
    for step in range(5):
        row = torch.randn(1, vocab, generator=gen) * 3
        alone = run(row, [target], seeds=[1234], steps=[step]).next_tokens[0]
        for pos in range(8):
            params = others[:pos] + [target] + others[pos:]
            logits = torch.randn(8, vocab, generator=gen) * 3
            logits[pos] = row[0]
            seeds = [99 + j for j in range(8)]
            seeds[pos] = 1234
            steps = [j * 13 for j in range(8)]
            steps[pos] = step
            got = run(logits, params, seeds=seeds, steps=steps).next_tokens[pos]
            assert got == alone, (step, pos)


def test_different_seeds_and_steps_give_different_tokens() -> None:
    logits = torch.zeros(256, 1000)  # uniform: any collision pattern is pure noise
    by_seed = run(logits, [SamplingParams()] * 256, seeds=list(range(256)))
    assert by_seed.next_tokens.unique().numel() > 200
    by_step = run(logits, [SamplingParams()] * 256, seeds=[7] * 256, steps=list(range(256)))
    assert by_step.next_tokens.unique().numel() > 200
    repeat = run(logits, [SamplingParams()] * 256, seeds=[7] * 256, steps=[3] * 256)
    assert repeat.next_tokens.unique().numel() == 1


# --- distributions -----------------------------------------------------------------------

LOGITS8 = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.5])
def test_samples_follow_softmax(temperature: float) -> None:
    counts = draw_counts(LOGITS8, SamplingParams(temperature=temperature), 20_000)
    assert chi2_pvalue(counts, torch.softmax(LOGITS8 / temperature, -1)) > P_MIN


def test_samples_follow_softmax_over_steps_of_one_seed() -> None:
    n = 20_000
    out = run(LOGITS8.expand(n, -1), [SamplingParams()] * n, seeds=[42] * n, steps=list(range(n)))
    counts = torch.bincount(out.next_tokens, minlength=8)
    assert chi2_pvalue(counts, torch.softmax(LOGITS8, -1)) > P_MIN


def test_top_k_keeps_top_k_in_ratio() -> None:
    # Rows with different k share one batch, so the per-row mask does the work rather
    # than the batch-wide truncation to the largest k.
    n = 20_000
    for other in (SamplingParams(top_k=5), SamplingParams(top_k=-1)):
        params = [SamplingParams(top_k=2), other] * (n // 2)
        out = run(LOGITS8.expand(n, -1), params, seeds=list(range(n)))
        top2 = torch.bincount(out.next_tokens[0::2], minlength=8)
        assert top2[2:].sum() == 0
        assert chi2_pvalue(top2[:2], torch.softmax(LOGITS8[:2], -1)) > P_MIN
        rest = torch.bincount(out.next_tokens[1::2], minlength=8)
        k = other.top_k if other.top_k > 0 else 8
        assert rest[k:].sum() == 0
        assert chi2_pvalue(rest[:k], torch.softmax(LOGITS8[:k], -1)) > P_MIN


# probs 0.5, 0.3, 0.15, 0.05 -> exclusive prefix mass 0, 0.5, 0.8, 0.95
PROBS4 = torch.tensor([0.5, 0.3, 0.15, 0.05])


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        (SamplingParams(top_p=0.75), 2),
        (SamplingParams(top_p=0.85), 3),
        (SamplingParams(top_p=0.3), 1),
        (SamplingParams(min_p=0.2), 3),  # threshold 0.1
        (SamplingParams(min_p=0.5), 2),  # threshold 0.25
        # Top-p runs on the top-k survivors renormalised: mass before = 0, 0.53, 0.84
        (SamplingParams(top_k=3, top_p=0.83), 2),
        (SamplingParams(top_k=2, top_p=0.6), 1),  # 0, 0.625
        (SamplingParams(top_p=0.85, min_p=0.5), 2),
    ],
)
def test_top_p_and_min_p_keep_right_set(params: SamplingParams, kept: int) -> None:
    counts = draw_counts(PROBS4.log(), params, 20_000)
    assert counts[kept:].sum() == 0
    assert bool((counts[:kept] > 0).all())
    if kept > 1:
        assert chi2_pvalue(counts[:kept], PROBS4[:kept] / PROBS4[:kept].sum()) > P_MIN


def allowed(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """Reference filter, one token at a time: top-k, then top-p on the survivors, then min-p."""
    order = sorted(range(row.numel()), key=lambda v: -float(row[v]))
    if p.top_k > 0:
        order = order[: p.top_k]
    probs = torch.softmax(row[order].double() / p.temperature, -1).tolist()
    keep, mass = [], 0.0
    for v, pr in zip(order, probs, strict=True):
        if p.top_p < 1 and mass >= p.top_p - 1e-6:
            break
        if pr < p.min_p * probs[0] - 1e-9:
            break
        keep.append(v)
        mass += pr
    return set(keep)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    temperature=st.floats(0.2, 3.0),
    top_k=st.sampled_from([-1, 2, 5, 17]),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 0.2]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
)
def test_sampled_tokens_always_in_reference_set(
    seed: int, temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    row = torch.randn(1, 40, generator=torch.Generator().manual_seed(seed)) * 2
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    n = 512
    out = run(row.expand(n, -1), [p] * n, seeds=[seed] * n, steps=list(range(n)))
    ok = allowed(row[0], p)
    assert set(out.next_tokens.tolist()) <= ok
    # With this many draws the top token of a non-trivial set essentially always shows up.
    assert int(row[0].argmax()) in set(out.next_tokens.tolist())


# --- penalties ---------------------------------------------------------------------------


def reference_penalties(
    logits: list[float], prompt: list[int], output: list[int], p: SamplingParams
) -> list[float]:
    out = []
    for v, x in enumerate(logits):
        if v in prompt or v in output:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        c = output.count(v)
        x -= p.frequency_penalty * c + p.presence_penalty * (1.0 if c > 0 else 0.0)
        out.append(x)
    return out


def test_penalty_state_lazy_reset_and_add() -> None:
    state = PenaltyState(max_slots=4, vocab_size=6, device="cpu")
    state.add_tokens(torch.tensor([0]), torch.tensor([1]))  # no-op before allocation
    assert state.output_counts is None
    state.reset_slot(2, torch.tensor([0, 3, 3]))
    state.add_tokens(torch.tensor([2, 2, 2, 1]), torch.tensor([5, 5, 1, 4]))
    assert state.output_counts is not None and state.prompt_mask is not None
    assert state.output_counts[2].tolist() == [0, 1, 0, 0, 0, 2]
    assert state.output_counts[1].tolist() == [0, 0, 0, 0, 1, 0]
    assert state.prompt_mask[2].tolist() == [True, False, False, True, False, False]
    state.reset_slot(2, torch.tensor([1]), output_ids=torch.tensor([4, 4]))
    assert state.output_counts[2].tolist() == [0, 0, 0, 0, 2, 0]
    assert state.prompt_mask[2].tolist() == [False, True, False, False, False, False]


def test_penalties_match_reference() -> None:
    vocab = 6
    logits = torch.tensor(
        [
            [1.0, -2.0, 0.5, 3.0, -0.5, 0.0],
            [2.0, 1.0, -1.0, 0.5, 0.25, -3.0],
            [0.1, 0.2, 0.3, -0.4, -0.5, 0.6],
        ]
    )
    params = [
        SamplingParams(temperature=0, repetition_penalty=2.0),
        SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(temperature=0, repetition_penalty=0.8, frequency_penalty=-0.3),
    ]
    prompts = [[0, 1], [2], [3, 4]]
    outputs = [[3, 3, 4], [0, 0, 1, 0], [5]]
    slots = [3, 0, 1]  # batch row -> slot, deliberately not the identity
    state = PenaltyState(max_slots=4, vocab_size=vocab, device="cpu")
    for slot, prompt in zip(slots, prompts, strict=True):
        state.reset_slot(slot, torch.tensor(prompt))
    for slot, output in zip(slots, outputs, strict=True):
        state.add_tokens(torch.full((len(output),), slot), torch.tensor(output))
    batch = SamplingBatch.build(params, [0, 0, 0], [0, 0, 0], "cpu")
    penalised = Sampler._apply_penalties(logits, batch, state, torch.tensor(slots))
    for b in range(3):
        ref = reference_penalties(logits[b].tolist(), prompts[b], outputs[b], params[b])
        torch.testing.assert_close(penalised[b], torch.tensor(ref))
    # Greedy picks the argmax of the penalised logits (row 0: token 3 is 3.0 -> 1.5).
    out = SAMPLER.sample(logits, batch, state, torch.tensor(slots))
    assert torch.equal(out.next_tokens, torch.tensor(ref_argmax(penalised)))
    with pytest.raises(ValueError, match="PenaltyState"):
        SAMPLER.sample(logits, batch)


def ref_argmax(x: torch.Tensor) -> list[int]:
    return [max(range(x.shape[1]), key=lambda v: float(x[b, v])) for b in range(x.shape[0])]


def test_penalties_in_sampled_rows_shift_distribution() -> None:
    # A large presence penalty on token 0 must make it (almost) never sampled.
    state = PenaltyState(1, 8, "cpu")
    state.reset_slot(0, torch.tensor([], dtype=torch.int64), output_ids=torch.tensor([0]))
    n = 4000
    out = run(
        LOGITS8.expand(n, -1),
        [SamplingParams(presence_penalty=2.0)] * n,
        state=state,
        rows=torch.zeros(n, dtype=torch.int64),
    )
    counts = torch.bincount(out.next_tokens, minlength=8)
    shifted = LOGITS8.clone()
    shifted[0] -= 2.0
    assert chi2_pvalue(counts, torch.softmax(shifted, -1)) > P_MIN


# --- validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("frequency_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("presence_penalty", 3.0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("min_tokens", 17),  # > max_tokens (16)
        ("top_logprobs", 21),
        ("top_logprobs", -1),
        ("n", 0),
        ("stop", ""),
        ("stop", ["ok", ""]),
    ],
)
def test_validation_names_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert repr(value) in str(info.value)
    # A changed copy is checked again (the object itself is frozen).
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(SamplingParams(), **{field: value})


def test_valid_params_and_normalisation() -> None:
    p = SamplingParams(temperature=0, top_p=1.0, top_k=0, min_p=1.0, stop="###")
    assert p.is_greedy and p.stop == ["###"] and p.stop_strings == ("###",)
    assert p.stop_token_ids == []
    assert SamplingParams(top_k=1).is_greedy and not SamplingParams().is_greedy
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]  # type: ignore[arg-type]
    SamplingParams(frequency_penalty=-2, presence_penalty=2, top_logprobs=20, min_tokens=16)


# --- device: no host syncs ---------------------------------------------------------------


@pytest.mark.gpu
def test_sample_does_not_sync_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(5)).bfloat16()
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.2, top_logprobs=3),
        SamplingParams(temperature=0.7, top_p=0.9, frequency_penalty=0.5),
        SamplingParams(temperature=1.0, top_k=20, min_p=0.1, presence_penalty=0.3),
        SamplingParams(temperature=1.0, logprobs=True),
    ] * 2
    rows = torch.arange(8)

    def fresh_state(device: torch.device | str) -> PenaltyState:
        state = PenaltyState(8, 1000, device)
        for slot in range(8):
            state.reset_slot(slot, torch.tensor([1, 2, 3]), torch.tensor([4, 4]))
        return state

    def sample(sampler: Sampler, device: torch.device | str) -> torch.Tensor:
        batch = SamplingBatch.build(params, list(range(8)), [3] * 8, device)
        out = sampler.sample(logits.to(device), batch, fresh_state(device), rows.to(device))
        return out.next_tokens.cpu()

    gpu_logits, gpu_rows = logits.to(dev), rows.to(dev)
    fresh_state(dev)  # warm the pinned-memory pool outside the checked region
    # No penalties, no filters: the fused Triton pass (greedy rows inside, logits in bf16).
    plain = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0, logprobs=True)] * 4
    fused_sampler = Sampler(use_triton=True)
    fused_sampler.sample(gpu_logits, SamplingBatch.build(plain, list(range(8)), [3] * 8, dev))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        # Host -> device steps (reset_slot, build) must not sync either.
        state = fresh_state(dev)
        batch = SamplingBatch.build(params, list(range(8)), [3] * 8, dev)
        greedy = SamplingBatch.build([SamplingParams(temperature=0)] * 8, [0] * 8, [0] * 8, dev)
        out = SAMPLER.sample(gpu_logits, batch, state, gpu_rows)
        state.add_tokens(gpu_rows, out.next_tokens)
        SAMPLER.sample(gpu_logits, greedy)
        plain_batch = SamplingBatch.build(plain, list(range(8)), [3] * 8, dev)
        fused = fused_sampler.sample(gpu_logits, plain_batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu_plain = SamplingBatch.build(plain, list(range(8)), [3] * 8, "cpu")
    assert torch.equal(fused.next_tokens.cpu(), SAMPLER.sample(logits, cpu_plain).next_tokens)
    # Same hash on both devices -> same tokens (barring exact float ties, absent here).
    assert torch.equal(out.next_tokens.cpu(), sample(SAMPLER, "cpu"))
    # The Triton race fuses the hash into one kernel but must draw the same tokens.
    assert torch.equal(out.next_tokens.cpu(), sample(Sampler(use_triton=True), dev))
