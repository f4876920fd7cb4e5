"""The fused float32 CPU kernels (csrc/cpu_kernels.c) against torch's ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisgl.kernels import cpu
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import _rotate

pytestmark = pytest.mark.skipif(not cpu.built(), reason="CPU kernels not built")


@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(rows: int, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x, res = torch.randn(rows, 576, generator=g), torch.randn(rows, 576, generator=g)
    w = torch.rand(576, generator=g) + 0.5
    norm = RMSNorm(576, 1e-5)
    norm.weight.data.copy_(w)
    total = x + res if with_residual else x
    want = norm.forward(total)
    out, got_total = cpu.add_rms_norm(x, res if with_residual else None, w, 1e-5)
    assert torch.equal(got_total, total)
    torch.testing.assert_close(out, want, rtol=2e-6, atol=2e-6)


def test_rope_in_place_equals_torch_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(0)
    t, hq, hk, d = 5, 9, 3, 64
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g)
    emb = torch.randn(100, d, generator=g)
    cos, sin = emb.cos(), emb.sin()
    pos = torch.tensor([0, 3, 17, 42, 99])
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    want_q = _rotate(q, cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
    want_k = _rotate(k, cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
    v_before = qkv[:, (hq + hk) * d :].clone()
    cpu.rope_(qkv, pos, cos, sin, hq + hk)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (hq + hk) * d :], v_before)


def test_decode_attention_against_sdpa() -> None:
    g = torch.Generator().manual_seed(1)
    hq, hk, d, slots = 8, 2, 64, 300
    kc, vc = torch.randn(slots, hk, d, generator=g), torch.randn(slots, hk, d, generator=g)
    lens = [1, 37, 120]
    index = torch.zeros(3, 128, dtype=torch.int64)
    for b, n in enumerate(lens):
        index[b, :n] = torch.randperm(slots, generator=g)[:n]
    q = torch.randn(3, hq * 2, d, generator=g)[:, ::2]  # a strided view, as q inside qkv
    # This step's K/V (the last position of each request) arrive with the call.
    new_k, new_v = torch.randn(3, hk, d, generator=g), torch.randn(3, hk, d, generator=g)
    slots = torch.tensor([index[b, n - 1] for b, n in enumerate(lens)])
    out = cpu.decode_attention(q, kc, vc, index, torch.tensor(lens), 0.125, (new_k, new_v, slots))
    assert torch.equal(kc[slots], new_k) and torch.equal(vc[slots], new_v)
    for b, n in enumerate(lens):
        k = kc[index[b, :n]].transpose(0, 1)  # [hk, n, d]
        v = vc[index[b, :n]].transpose(0, 1)
        want = F.scaled_dot_product_attention(
            q[b].unsqueeze(1), k, v, scale=0.125, enable_gqa=True
        )  # [hq, 1, d]
        torch.testing.assert_close(out[b].view(hq, d), want.squeeze(1), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # the default model end to end; the kernels' own tests above are everyday
def test_default_model_greedy_and_logprobs_with_and_without_the_kernels() -> None:
    """The kernels change float32 summation order only: same greedy tokens (prefill and
    decode steps, three requests batched), logprobs close (the GGUF products quantize their
    activations to int16, so a last-bit change of an input can move one code: up to ~1e-3
    nats here over 30 layers)."""
    from minisgl import LLM, SamplingParams, env
    from minisgl.env import CPU_KERNELS

    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3,"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=True)
    runs = []
    for on in (True, False):
        with env.override({CPU_KERNELS: on}):
            llm = LLM(max_running_requests=4)
            runs.append(llm.generate(prompts, params, use_tqdm=False))
            llm.close()
    fused, plain = runs
    assert [r["token_ids"] for r in fused] == [r["token_ids"] for r in plain]
    diff = torch.tensor([r["logprobs"] for r in fused]) - torch.tensor(
        [r["logprobs"] for r in plain]
    )
    assert 0 < diff.abs().max() < 5e-3  # not 0: the kernels really ran in one of the two
