"""The decode kernel with q/k norm, RoPE and the K/V store folded in (kernels/decode_fold.py)
against what it replaces: fused_qk_norm_rope_store, then decode_attention on the rotated q.

The fold keeps each row whole, so its sum of squares may be ordered otherwise than the
fused store's: 1 / rms, and so a normed q or k element, may then differ in its last bit.
Everything else is bit-identical: v in the cache always, k where the norm's statistics
agree, and in Triton's interpreter (numpy sums each row alike in both layouts) every output
and cache byte. Checks run in one interpreter child on the CPU (tests/kernel_checks.py) and
natively on CUDA under the ``gpu`` marker.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if __name__ == "__main__":  # the interpreter child: make `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from minisgl.layers.rotary import RotaryEmbedding
from minisgl.models.config import RopeConfig
from tests import kernel_checks  # noqa: E402

if TYPE_CHECKING:  # triton is imported by the checks only, after TRITON_INTERPRET is set
    from minisgl.kernels.decode_fold import DecodeFold

F32, BF16 = torch.float32, torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-6
MAX_POS = 512
BLOCK_N = 16  # small tiles: a few hundred tokens make rows of several chunks


@dataclass
class Case:
    """A decode step of rows of ``seq_lens`` (the new token included) over a paged cache:
    q/k/v strided views of one raw QKV output, the new tokens' slots in the page table."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    k_cache: torch.Tensor  # random: a token the kernel must write is not there already
    v_cache: torch.Tensor
    table: torch.Tensor
    row_ids: torch.Tensor
    seq_lens: torch.Tensor
    num_splits: torch.Tensor
    max_splits: int


def _randn(*shape: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype)


def _case(
    device: torch.device,
    dtype: torch.dtype,
    seq_lens: list[int],
    hq: int,
    hk: int,
    d: int,
    norm: bool,
    max_splits: int = 4,
    cache_dtype: torch.dtype | None = None,
    seed: int = 0,
) -> Case:
    from minisgl.attention.triton_plan import aligned_splits

    g = torch.Generator().manual_seed(seed)
    bsz = len(seq_lens)
    emb = RotaryEmbedding(d, RopeConfig(theta=1e4), MAX_POS)
    # Large enough that the norm matters (rows far from unit RMS).
    qkv = 3 * _randn(bsz, (hq + 2 * hk) * d, dtype=dtype, g=g).to(device)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    num_slots = sum(seq_lens) + 9
    perm = torch.randperm(num_slots, generator=g)
    # Rows own shuffled slots; unused table entries hold valid-but-wrong slots.
    table = torch.randint(0, num_slots, (bsz + 2, max(seq_lens) + 5), generator=g)
    rows = torch.randperm(bsz + 2, generator=g)[:bsz]
    used = 0
    for row, n in zip(rows.tolist(), seq_lens):
        table[row, :n] = perm[used : used + n]
        used += n
    slots = torch.stack([table[r, n - 1] for r, n in zip(rows.tolist(), seq_lens)])
    want = [min(max_splits, -(-n // 32)) for n in seq_lens]
    splits = [aligned_splits(n, w, BLOCK_N) for n, w in zip(seq_lens, want)]
    weights = [(1 + 0.5 * _randn(d, dtype=F32, g=g)).to(dtype) if norm else None for _ in "qk"]
    cache = cache_dtype or dtype
    return Case(
        q=q.view(bsz, hq, d),
        k=k.view(bsz, hk, d),
        v=v.view(bsz, hk, d),
        positions=torch.tensor(seq_lens, device=device) - 1,
        slots=slots.to(device),
        cos=emb.cos_table.to(device),
        sin=emb.sin_table.to(device),
        q_weight=None if weights[0] is None else weights[0].to(device),
        k_weight=None if weights[1] is None else weights[1].to(device),
        k_cache=_randn(num_slots, hk, d, dtype=dtype, g=g).to(cache).to(device),
        v_cache=_randn(num_slots, hk, d, dtype=dtype, g=g).to(cache).to(device),
        table=table.to(torch.int32).to(device),
        row_ids=rows.to(torch.int32).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        num_splits=torch.tensor(splits, dtype=torch.int32, device=device),
        max_splits=max_splits,
    )


def _attend(c: Case, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, mode: int,
            fold: DecodeFold | None = None) -> torch.Tensor:  # fmt: skip
    from minisgl.kernels.decode_attention import decode_attention
    from minisgl.kernels.fp8_kv import KVRead

    scale = q.shape[2] ** -0.5
    return decode_attention(
        q, kc, vc, c.table, c.row_ids, c.seq_lens, c.num_splits, c.max_splits, scale,
        block_n=BLOCK_N, kv=KVRead(mode=mode), fold=fold,
    )  # fmt: skip


def unfused(c: Case, mode: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(attention output, k cache, v cache) of the two launches the fold replaces."""
    from minisgl.kernels.qk_rope_store import fused_qk_norm_rope_store

    kc, vc = c.k_cache.clone(), c.v_cache.clone()
    q = fused_qk_norm_rope_store(
        c.q, c.k, c.v, c.positions, c.cos, c.sin, kc, vc, c.slots, c.q_weight, c.k_weight, EPS
    )
    return _attend(c, q, kc, vc, mode), kc, vc


def folded(c: Case, mode: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from minisgl.kernels.decode_fold import DecodeFold

    kc, vc = c.k_cache.clone(), c.v_cache.clone()
    fold = DecodeFold(c.k, c.v, c.slots, c.positions, c.cos, c.sin, c.q_weight, c.k_weight, EPS)
    return _attend(c, c.q, kc, vc, mode, fold), kc, vc


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in representable steps of the tensors' dtype (same-sign values; for fp8
    the codes, compared as bytes)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return (a.view(ints).int() - b.view(ints).int()).abs()


def assert_matches(c: Case, what: str, mode: int = 0) -> None:
    """The fold's output and cache against the unfused launches'. Exact in the interpreter;
    natively, k (and through q, the output) may move by the last bit of a normed element."""
    inputs = [t.clone() for t in (c.q, c.k, c.v)]
    out_ref, k_ref, v_ref = unfused(c, mode)
    out, k_out, v_out = folded(c, mode)
    exact = c.q.device.type == "cpu"
    assert out.shape == out_ref.shape and out.dtype == out_ref.dtype, what
    assert torch.equal(_ulps(v_out, v_ref), torch.zeros_like(_ulps(v_out, v_ref))), what
    k_diff = _ulps(k_out, k_ref)
    if exact or c.q_weight is None:
        assert int(k_diff.max()) == 0, f"k cache differs: {what}"
        if exact:
            assert torch.equal(out, out_ref), f"output differs: {what}"
    else:  # 1 / rms summed in another order: a last-bit step of a few k elements
        assert int(k_diff.max()) <= 1 and float((k_diff > 0).float().mean()) < 0.02, what
    # q moved by at most a step of its dtype at a few elements: the scores by that much
    # times |k|, the output by a small multiple of its own rounding.
    tol = 1e-5 if c.q.dtype == F32 else 2**-6
    torch.testing.assert_close(out.float(), out_ref.float(), atol=tol, rtol=tol, msg=what)
    untouched = torch.ones(c.k_cache.shape[0], dtype=torch.bool, device=c.q.device)
    untouched[c.slots] = False
    for got, before in ((k_out, c.k_cache), (v_out, c.v_cache)):
        assert int(_ulps(got[untouched], before[untouched]).max()) == 0, f"stray write: {what}"
        assert int(_ulps(got[c.slots], before[c.slots]).max()) > 0, f"no store: {what}"
    for x, x0 in zip((c.q, c.k, c.v), inputs):
        assert torch.equal(x, x0), f"an input was modified: {what}"


# Rows: the new token alone, short, a few chunks, the most chunks (BLOCK_N 16, up to 4).
LENS = [1, 3, 40, 150]


# ---- checks: each takes the device and raises on mismatch ----


def check_bf16_split_rows(device: torch.device) -> None:
    for hq, hk, d, norm in ((4, 2, 64, True), (4, 2, 64, False), (8, 1, 128, True)):
        c = _case(device, BF16, LENS, hq, hk, d, norm)  # GQA and MQA
        assert c.num_splits.tolist() == [1, 1, 2, 4], c.num_splits
        assert_matches(c, f"bf16 norm={norm} hq={hq} hk={hk} d={d}")


def check_fp32_and_odd_head_dim(device: torch.device) -> None:
    """float32 (every product unrounded: what contraction would change) and a head_dim
    that is not a power of two (each column's RoPE partner in a padded tile)."""
    for norm in (True, False):
        assert_matches(_case(device, F32, LENS, 4, 2, 64, norm, seed=1), f"fp32 norm={norm}")
        c = _case(device, BF16, [5, 70], 6, 2, 80, norm, seed=2)
        assert_matches(c, f"bf16 d=80 norm={norm}")


def check_direct(device: torch.device) -> None:
    """max_splits 1: no reduction launch; each row's one program is its last chunk."""
    for norm in (True, False):
        c = _case(device, BF16, [1, 33, 90], 4, 2, 64, norm, max_splits=1, seed=3)
        assert c.num_splits.tolist() == [1, 1, 1]
        assert_matches(c, f"direct norm={norm}")


def check_fp8_cache(device: torch.device) -> None:
    """An fp8 cache: the new token stored with store_kv's saturating cast and read back
    through each conversion (fp8_kv.py: the upcast, the float16 cast, the bit moves);
    some v values lie past e4m3's max."""
    for cache, mode in ((E4M3, 0), (E4M3, 3), (E5M2, 1)):
        c = _case(device, BF16, LENS, 4, 2, 64, True, cache_dtype=cache, seed=4)
        c.v.mul_(100)
        assert_matches(c, f"{cache} mode {mode}", mode)


def check_more_modes_and_shapes(device: torch.device) -> None:
    """The other fp8 modes and cache kinds, MQA without the norm (slow in the interpreter:
    the paths above, other constants)."""
    for cache, mode in ((E4M3, 1), (E4M3, 2), (E5M2, 0), (E5M2, 3)):
        c = _case(device, BF16, LENS, 4, 2, 64, True, cache_dtype=cache, seed=6)
        c.v.mul_(100)
        assert_matches(c, f"{cache} mode {mode}", mode)
    assert_matches(_case(device, BF16, LENS, 8, 1, 128, False, seed=7), "MQA without norm")


def check_int32_indices_and_contiguous_inputs(device: torch.device) -> None:
    c = _case(device, BF16, [7, 60], 4, 2, 64, True, seed=5)
    c.positions, c.slots = c.positions.int(), c.slots.int()
    c.q, c.k, c.v = c.q.contiguous(), c.k.contiguous(), c.v.contiguous()
    assert_matches(c, "int32 positions and slots, contiguous q/k/v")


def _greedy(model: Path, fold: bool, dtype: str) -> tuple[list[object], list[object], int]:
    """A tiny model's greedy tokens and their logprobs through the offline API on the CPU,
    with the fused K/V store forced on (the engine turns it on for CUDA only) and the fold
    on or off; and how many folded decode launches ran."""
    from unittest import mock

    from minisgl import LLM, SamplingParams
    from minisgl.attention import triton_backend
    from minisgl.engine import engine

    make_backend, decode_attention = engine.make_backend, triton_backend.decode_attention
    folds = 0

    def fused_backend(name: str, pool: Any, device: Any, stager: Any, *flags: bool) -> Any:
        return make_backend(name, pool, device, stager, True, fold)

    def counting(*args: Any, **kw: Any) -> torch.Tensor:
        nonlocal folds
        folds += kw.get("fold") is not None
        return decode_attention(*args, **kw)

    with (
        mock.patch.object(engine, "make_backend", fused_backend),
        mock.patch.object(triton_backend, "decode_attention", counting),
    ):
        llm = LLM(str(model), attention_backend="triton", dtype=dtype, cuda_graph_max_bs=0)
        prompts = [list(range(3, 40)), list(range(50, 61))]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=True)
                  for n in (6, 3)]  # fmt: skip
        out = llm.generate(prompts, params, use_tqdm=False)
        llm.close()
    return [r["token_ids"] for r in out], [r["logprobs"] for r in out], folds


def check_tiny_models_decode_alike(device: torch.device) -> None:
    """Tiny random Qwen3 (q/k norm) and Llama (none) models decode the same tokens with the
    same logprobs with the fold on and off (two rows, then one). CPU only (slow: ~8 s a
    model in the interpreter): on CUDA tests/gpu/test_decode_fold_gpu.py decodes natively,
    teacher-forced."""
    import tempfile

    from tests.helpers import make_tiny_model

    if device.type != "cpu":
        raise kernel_checks.Skip("tests/gpu/test_decode_fold_gpu.py")
    with tempfile.TemporaryDirectory() as tmp:
        for arch, dtype in (("qwen3", "float32"), ("qwen3", "bfloat16"), ("llama", "float32")):
            model = make_tiny_model(Path(tmp) / arch, arch)
            tokens, logprobs, folds = _greedy(model, True, dtype)
            assert folds > 0, "the fold was not taken"
            assert (tokens, logprobs, 0) == _greedy(model, False, dtype), (arch, dtype)


CHECKS = kernel_checks.collect(globals())


test_interpreted, test_on_gpu = kernel_checks.make_tests(
    __file__, CHECKS, slow=("more_modes_and_shapes", "tiny_models_decode_alike")
)


if __name__ == "__main__":
    kernel_checks.main(CHECKS)
