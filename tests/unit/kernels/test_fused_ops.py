"""Triton RMSNorm / fused-add RMSNorm / RoPE / SiLU-and-mul against the torch layers.

Without CUDA the kernels run in Triton's interpreter, which triton only honours if
TRITON_INTERPRET is set before its first import. Other test modules may import triton
first, so every check runs in one child process started with the variable set (this file
run as a script prints a JSON verdict per check); each pytest test asserts on its entry.
The same checks run in-process on CUDA under the ``gpu`` marker.

The interpreter casts float32 -> bfloat16 by truncation, not round-to-nearest-even as
GPUs do, so bfloat16 results are compared with a tolerance of a few ulps here; float16
and float32 casts round correctly in it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

if __name__ == "__main__":  # the interpreter child: make `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from minisgl.layers import activation as torch_act
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding
from minisgl.models.config import RopeConfig
from tests import kernel_checks  # noqa: E402
from tests.kernel_checks import Skip  # noqa: E402

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (atol, rtol): float32 tight; half precision allows a few ulps (reduction order, exp, and
# the interpreter's truncating bf16 cast).
TOL = {F32: (1e-5, 1e-5), F16: (4e-3, 4e-3), BF16: (4e-2, 4e-2)}
EPS = 1e-6


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=atol, rtol=rtol)


def _rounds_like_torch(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether casts to ``dtype`` round to nearest even here, as torch's do."""
    return dtype == F16 or (dtype == BF16 and device.type == "cuda")


def _same_rounding(out: torch.Tensor, ref: torch.Tensor, min_frac: float = 0.99) -> None:
    """Nearly all elements bit-equal: the kernel rounds at the reference's points (a float32
    reduction or exp in another order may still flip an occasional last bit)."""
    frac = (out.cpu() == ref).float().mean().item()
    assert frac >= min_frac, f"only {frac:.4f} of elements match the reference exactly"


def _randn(*shape: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(device)


def _norm_layer(d: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    """A CPU layer (so it runs the torch reference path) with a non-trivial weight."""
    layer = RMSNorm(d, EPS)
    layer.weight.data = 1 + 0.5 * _randn(d, dtype=F32, device=torch.device("cpu"), seed=seed)
    return layer.to(dtype)


# ---- checks: each takes the device and raises on mismatch ----


def check_rms_norm(device: torch.device) -> None:
    from minisgl.kernels.norm import rms_norm

    for dtype in (F32, BF16, F16):
        for rows, d in ((5, 96), (3, 576), (37, 64), (1, 1000)):
            layer = _norm_layer(d, dtype, seed=d)
            x = _randn(rows, d, dtype=dtype, device=device, seed=rows)
            out = rms_norm(x, layer.weight.to(device), EPS)
            _close(out, layer(x.cpu()), dtype)
            if _rounds_like_torch(dtype, device):
                _same_rounding(out, layer(x.cpu()))


def check_fused_add_rms_norm(device: torch.device) -> None:
    from minisgl.kernels.norm import fused_add_rms_norm

    for dtype in (F32, BF16, F16):
        for rows, d in ((5, 96), (4, 576), (33, 128)):
            layer = _norm_layer(d, dtype, seed=d)
            x = _randn(rows, d, dtype=dtype, device=device, seed=1)
            res = 3 * _randn(rows, d, dtype=dtype, device=device, seed=2)
            out, new_res = fused_add_rms_norm(x, res, layer.weight.to(device), EPS)
            ref_out, ref_res = layer.forward_with_residual(x.cpu(), res.cpu())
            _close(out, ref_out, dtype)
            _close(new_res, ref_res, dtype)
            if _rounds_like_torch(dtype, device):  # one correctly rounded add: exact
                assert torch.equal(new_res.cpu(), ref_res)
                _same_rounding(out, ref_out)


def check_qk_norm_strided_heads(device: torch.device) -> None:
    """q/k norm over head_dim straight on [T, H, D] slices of a fused QKV output."""
    from minisgl.kernels.norm import rms_norm

    t, hq, hk, d = 7, 6, 2, 64
    for dtype in (F32, BF16):
        layer = _norm_layer(d, dtype, seed=3)
        qkv = _randn(t, (hq + 2 * hk) * d, dtype=dtype, device=device, seed=4)
        q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        q, k = q.view(t, hq, d), k.view(t, hk, d)
        for x in (q, k):
            assert not x.is_contiguous()
            _close(rms_norm(x, layer.weight.to(device), EPS), layer(x.cpu()), dtype)


def check_rms_norm_weight_promotion(device: torch.device) -> None:
    """A float32 weight on bf16 activations gives float32 out, as `weight * normed` does."""
    from minisgl.kernels.norm import rms_norm

    layer = _norm_layer(96, F32, seed=5)
    x = _randn(4, 96, dtype=BF16, device=device, seed=6)
    _close(rms_norm(x, layer.weight.to(device), EPS), layer(x.cpu()), BF16)


def _rope_case(
    device: torch.device, dtype: torch.dtype, t: int, hq: int, hk: int, d: int, rope: RopeConfig
) -> tuple[RotaryEmbedding, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference module, shuffled positions (with repeats), strided q/k views, the qkv."""
    emb = RotaryEmbedding(d, rope, 256)
    g = torch.Generator().manual_seed(t * 31 + d)
    positions = torch.randint(0, 256, (t,), generator=g).to(device)
    qkv = _randn(t, (hq + 2 * hk) * d, dtype=dtype, device=device, seed=d + hq)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    return emb, positions, q.view(t, hq, d), k.view(t, hk, d), qkv


ROPE_SCHEDULES = [
    RopeConfig(),
    RopeConfig(theta=500000.0, scaling_type="llama3", scaling=(("factor", 8.0),)),
    RopeConfig(theta=1e6, scaling_type="yarn", scaling=(("factor", 4.0),), max_position=64),
]


def check_rope(device: torch.device) -> None:
    from minisgl.kernels.rope import apply_rope

    # (T, Hq, Hk, D): GQA, MQA, a non-power-of-two head_dim, more heads than one tile.
    shapes = [(9, 6, 2, 64), (5, 4, 1, 80), (3, 40, 8, 128), (1, 2, 2, 32)]
    for dtype in (F32, BF16, F16):
        for (t, hq, hk, d), rope in zip(shapes, ROPE_SCHEDULES * 2, strict=False):
            emb, pos, q, k, _ = _rope_case(device, dtype, t, hq, hk, d, rope)
            q_out, k_out = apply_rope(pos, q, k, emb.cos.to(device), emb.sin.to(device))
            q_ref, k_ref = emb(pos.cpu(), q.cpu(), k.cpu())
            _close(q_out, q_ref, dtype)
            _close(k_out, k_ref, dtype)
            if _rounds_like_torch(dtype, device):  # same rounding points: bit-exact
                assert torch.equal(q_out.cpu(), q_ref) and torch.equal(k_out.cpu(), k_ref)


def check_rope_inplace(device: torch.device) -> None:
    from minisgl.kernels.rope import apply_rope

    emb, pos, q, k, qkv = _rope_case(device, F32, 6, 4, 2, 64, RopeConfig())
    v_before = qkv[:, 6 * 64 :].clone()
    q_ref, k_ref = emb(pos.cpu(), q.cpu(), k.cpu())
    q_out, k_out = apply_rope(pos, q, k, emb.cos.to(device), emb.sin.to(device), inplace=True)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()
    _close(q, q_ref, F32)
    _close(k, k_ref, F32)
    assert torch.equal(qkv[:, 6 * 64 :], v_before), "in-place RoPE touched v"


def check_silu_and_mul(device: torch.device) -> None:
    from minisgl.kernels.activation import silu_and_mul

    for dtype in (F32, BF16, F16):
        for shape in ((3, 2 * 96), (2, 2 * 576), (2, 2 * 1500), (2, 3, 2 * 64)):
            x = 4 * _randn(*shape, dtype=dtype, device=device, seed=shape[-1])
            out, ref = silu_and_mul(x), torch_act.silu_and_mul(x.cpu())
            _close(out, ref, dtype)
            if _rounds_like_torch(dtype, device):
                _same_rounding(out, ref)
    # Rows of a wider buffer: row stride != 2I.
    wide = _randn(4, 300, dtype=F32, device=device, seed=7)
    x = wide[:, : 2 * 100]
    _close(silu_and_mul(x), torch_act.silu_and_mul(x.cpu()), F32)


def check_empty_inputs(device: torch.device) -> None:
    from minisgl.kernels.activation import silu_and_mul
    from minisgl.kernels.norm import fused_add_rms_norm, rms_norm
    from minisgl.kernels.rope import apply_rope

    w = torch.ones(64, device=device)
    x = torch.empty(0, 64, device=device)
    assert rms_norm(x, w, EPS).shape == (0, 64)
    assert fused_add_rms_norm(x, x, w, EPS)[1].shape == (0, 64)
    assert silu_and_mul(torch.empty(0, 128, device=device)).shape == (0, 64)
    cs = torch.ones(8, 64, device=device)
    pos = torch.empty(0, dtype=torch.int64, device=device)
    q, k = torch.empty(0, 4, 64, device=device), torch.empty(0, 2, 64, device=device)
    assert [t.shape for t in apply_rope(pos, q, k, cs, cs)] == [q.shape, k.shape]


def check_layers_dispatch(device: torch.device) -> None:
    """On CUDA the torch layers route to the kernels and still match their CPU path."""
    if device.type != "cuda":
        raise Skip("layer dispatch to Triton happens only for CUDA tensors")
    dtype = BF16
    layer = _norm_layer(576, dtype, seed=8)
    gpu_layer = _norm_layer(576, dtype, seed=8).to(device)
    x = _randn(5, 576, dtype=dtype, device=device, seed=9)
    res = _randn(5, 576, dtype=dtype, device=device, seed=10)
    _close(gpu_layer(x), layer(x.cpu()), dtype)
    for a, b in zip(
        gpu_layer.forward_with_residual(x, res),
        layer.forward_with_residual(x.cpu(), res.cpu()),
        strict=True,
    ):
        _close(a, b, dtype)
    emb, pos, q, k, _ = _rope_case(device, dtype, 5, 4, 2, 64, RopeConfig())
    ref = emb(pos.cpu(), q.cpu(), k.cpu())
    for a, b in zip(emb.to(device)(pos, q, k), ref, strict=True):
        assert torch.equal(a.cpu(), b), "RoPE should be bit-exact on GPU"
    gated = _randn(3, 2 * 576, dtype=dtype, device=device, seed=11)
    _close(torch_act.silu_and_mul(gated), torch_act.silu_and_mul(gated.cpu()), dtype)


@contextlib.contextmanager
def _race_chunks(min_programs: int) -> Iterator[None]:
    """Chunk the race as if a batch needed ``min_programs`` programs: 1 gives the largest
    chunks (4 blocks) on small test inputs, the default one block per chunk."""
    from minisgl.kernels import sampling

    saved = sampling._MIN_PROGRAMS
    sampling._MIN_PROGRAMS = min_programs
    try:
        yield
    finally:
        sampling._MIN_PROGRAMS = saved


CHUNKINGS = (1, 1 << 20)  # 4-block chunks, 1-block chunks


def check_sampling_race(device: torch.device) -> None:
    """The Triton race draws what the eager race draws: same hash, same winner (the float
    logs may round a few ulps apart, so a rare near-tie is allowed to differ)."""
    for min_programs in CHUNKINGS:
        with _race_chunks(min_programs):
            _sampling_race(device)


def _sampling_race(device: torch.device) -> None:
    from minisgl.engine.noise import race
    from minisgl.kernels.sampling import triton_race

    g = torch.Generator().manual_seed(0)
    rows, vocab = 64, 5000
    scores = torch.randn(rows, vocab, generator=g) * 2
    scores[3, :4000] = float("-inf")  # masked entries never win
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=g)
    seeds[:2] = torch.tensor([-(2**63), 2**63 - 1])  # extreme keys hash like any other
    steps = torch.randint(0, 4096, (rows,), generator=g)
    cases = [(scores, torch.arange(vocab))]
    top_ids = torch.randint(0, 150_000, (rows, 50), generator=g)  # a top-k's columns
    cases.append((torch.randn(rows, 50, generator=g), top_ids))
    for sc, ids in cases:
        want = race(sc, seeds, steps, ids)
        got = triton_race(sc.to(device), seeds.to(device), steps.to(device), ids.to(device))
        assert got.dtype == torch.int64
        same = (got.cpu() == want).float().mean().item()
        assert same >= 0.98, f"only {same:.3f} of rows drew the eager race's winner"
    vocab_ids = torch.arange(vocab, device=device)
    full = triton_race(scores.to(device), seeds.to(device), steps.to(device), vocab_ids)
    assert full[3].item() >= 4000
    # Rows are independent: a row's draw does not depend on the rest of the batch.
    alone = triton_race(
        scores[5:6].to(device), seeds[5:6].to(device), steps[5:6].to(device), vocab_ids
    )
    assert alone.item() == full[5].item()
    # A row with every entry masked gives column 0, as the eager race's argmax does.
    masked = torch.full((2, 3000), float("-inf"), device=device)
    got = triton_race(masked, seeds[:2].to(device), steps[:2].to(device), vocab_ids[:3000])
    assert got.tolist() == [0, 0]


def _sample_case(
    rows: int, vocab: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits, temperatures (every other row greedy, from row 0), seeds, steps; on the CPU."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    temps = torch.rand(rows, generator=g) * 1.5 + 0.1
    temps[::2] = 0.0
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=g)
    steps = torch.randint(0, 4096, (rows,), generator=g)
    return logits, temps, seeds, steps


def _race_values(
    logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """The eager sampler's race values: x / T - log E, x = the logits in float32."""
    from minisgl.engine.noise import uniform_noise

    x = logits.float()
    scaled = x / torch.where(temps == 0, torch.ones_like(temps), temps)[:, None]
    neg_u = -uniform_noise(seeds, steps, torch.arange(x.shape[1]))
    return scaled - neg_u.log1p().neg().log()


def _sample_ref(
    logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """What the eager sampler draws: the race on x / T; greedy rows the argmax of x."""
    from minisgl.engine.noise import race

    x = logits.float()
    scaled = x / torch.where(temps == 0, torch.ones_like(temps), temps)[:, None]
    drawn = race(scaled, seeds, steps, torch.arange(x.shape[1]))
    return torch.where(temps == 0, x.argmax(-1), drawn)


def _assert_same_draws(got: torch.Tensor, case: tuple[torch.Tensor, ...], dev: str) -> None:
    """Greedy rows exactly the argmax; sampled rows exactly the eager draw when interpreted
    (numpy's float logs round as torch's), and on a GPU up to a near-tie its logs may flip."""
    logits, temps, seeds, steps = case
    got, want = got.cpu(), _sample_ref(*case)
    assert got.dtype == torch.int64 and got.shape == want.shape
    greedy = temps == 0
    assert torch.equal(got[greedy], want[greedy]), (got, want)
    if dev == "cpu":
        assert torch.equal(got, want), (got, want)
        return
    vals = _race_values(logits, temps, seeds, steps)
    for b in (got != want).nonzero().flatten().tolist():
        a, w = float(vals[b, got[b]]), float(vals[b, want[b]])
        assert abs(a - w) <= 1e-5 * max(1.0, abs(w)), (b, a, w)


def check_sampling_fused(device: torch.device) -> None:
    """Temperature, greedy rows and the race in one pass draw the eager sampler's tokens, from
    logits in any float dtype, at vocab sizes that are not a multiple of a block or chunk."""
    from minisgl.kernels.sampling import triton_sample

    shapes = ((1, 5000), (3, 5000), (7, 5000), (2, 151936), (4, 2048), (3, 2049))
    for min_programs in CHUNKINGS:
        with _race_chunks(min_programs):
            for dtype in (F32, BF16, F16):
                for i, (rows, vocab) in enumerate(shapes):
                    case = _sample_case(rows, vocab, dtype, seed=i)
                    got = triton_sample(*(t.to(device) for t in case))
                    _assert_same_draws(got, case, device.type)
    # Rows of a wider buffer (a vocab-padded LM head's slice) and a batch with no greedy row.
    logits, temps, seeds, steps = _sample_case(5, 3000, BF16, seed=9)
    wide = torch.cat([logits, torch.full((5, 72), 100.0, dtype=BF16)], dim=1).to(device)
    temps[:] = 0.8
    got = triton_sample(wide[:, :3000], temps.to(device), seeds.to(device), steps.to(device))
    _assert_same_draws(got, (logits, temps, seeds, steps), device.type)


def check_sampling_fused_ties(device: torch.device) -> None:
    """Greedy rows keep torch.argmax's first maximum across lanes, blocks and chunks."""
    from minisgl.kernels.sampling import triton_sample

    vocab = 20_000
    # (columns holding the row's maximum): different chunks; an earlier column in a later
    # lane; one lane in two blocks; three ways, one in the last, partial block.
    ties = [(17_000, 9_000), (2_050, 5), (100, 2_148), (19_999, 12_288, 4_096)]
    for min_programs in CHUNKINGS:
        with _race_chunks(min_programs):
            for dtype in (F32, BF16):
                logits, temps, seeds, steps = _sample_case(len(ties) + 2, vocab, dtype, seed=11)
                for row, cols in enumerate(ties):
                    logits[row, list(cols)] = 50.0
                logits[len(ties)] = 0.0  # all equal: column 0
                temps[: len(ties) + 1] = 0.0  # the last row samples
                case = (logits, temps, seeds, steps)
                got = triton_sample(*(t.to(device) for t in case)).cpu()
                assert got[: len(ties) + 1].tolist() == [min(c) for c in ties] + [0]
                _assert_same_draws(got, case, device.type)


def check_sampler_uses_fused_path(device: torch.device) -> None:
    """`Sampler(use_triton=True)` gives the eager Sampler's tokens and logprobs, on the fused
    path (mixed greedy rows, logprobs) and on the top-k path (`triton_race` with ids)."""
    from minisgl.engine.sampler import Sampler, SamplingBatch
    from minisgl.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(12)
    logits = (torch.randn(6, 3000, generator=g) * 3).to(BF16)
    plain = [
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2),
        SamplingParams(temperature=0.6),
        SamplingParams(temperature=1.3, top_k=1),  # greedy
        SamplingParams(temperature=0.9, logprobs=True),
    ] * 2
    top_k = [SamplingParams(temperature=0.7, top_k=40), SamplingParams(temperature=0.0)] * 3
    for params in (plain[:6], top_k):
        seeds, steps = list(range(100, 106)), [3, 1, 4, 1, 5, 9]
        want = Sampler().sample(logits, SamplingBatch.build(params, seeds, steps, "cpu"))
        batch = SamplingBatch.build(params, seeds, steps, device)
        got = Sampler(use_triton=True).sample(logits.to(device), batch)
        assert torch.equal(got.next_tokens.cpu(), want.next_tokens)
        for a, b in (
            (got.chosen_logprobs, want.chosen_logprobs),
            (got.top_logprobs, want.top_logprobs),
        ):
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                torch.testing.assert_close(a.cpu(), b)


CHECKS = kernel_checks.collect(globals())


test_interpreted, test_on_gpu = kernel_checks.make_tests(__file__, CHECKS, slow=("sampling_race",))


if __name__ == "__main__":
    kernel_checks.main(CHECKS)
