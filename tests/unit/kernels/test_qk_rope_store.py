"""The fused q/k-norm + RoPE + KV-store kernel against the unfused kernels it replaces
(rms_norm on q and k, apply_rope, store_kv): bit-identical outputs and cache writes.

Checks run in one interpreter child on the CPU (see tests/kernel_checks.py) and in-process
on CUDA under the ``gpu`` marker. Both sides are Triton kernels, so even the interpreter's
truncating bfloat16 casts apply to both alike: every comparison is torch.equal.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

if __name__ == "__main__":  # the interpreter child: make `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from minisgl.layers.rotary import RotaryEmbedding
from minisgl.models.config import RopeConfig
from tests import kernel_checks  # noqa: E402

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
EPS = 1e-6
MAX_POS = 512


def _randn(*shape: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(device)


@dataclass
class Case:
    """One layer's inputs: q/k/v are strided views of one fused QKV output."""

    qkv: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    k_cache: torch.Tensor  # random, so rows the kernel must not touch are recognisable
    v_cache: torch.Tensor
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None


def _case(
    device: torch.device,
    dtype: torch.dtype,
    t: int,
    hq: int,
    hk: int,
    d: int,
    norm: bool,
    rope: RopeConfig | None = None,
    cache_dtype: torch.dtype | None = None,
) -> Case:
    seed = t * 1009 + hq * 101 + hk * 11 + d
    g = torch.Generator().manual_seed(seed)
    emb = RotaryEmbedding(d, rope or RopeConfig(theta=1e6), MAX_POS)
    # Large enough that RMSNorm's scaling matters, with some rows far from unit RMS.
    qkv = 3 * _randn(t, (hq + 2 * hk) * d, dtype=dtype, device=device, seed=seed)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    num_slots = 4 * t + 7
    cache_dtype = cache_dtype or dtype
    weights = [
        (1 + 0.5 * _randn(d, dtype=F32, device=device, seed=seed + i)).to(dtype) if norm else None
        for i in (1, 2)
    ]
    return Case(
        qkv=qkv,
        q=q.view(t, hq, d),
        k=k.view(t, hk, d),
        v=v.view(t, hk, d),
        positions=torch.randint(0, MAX_POS, (t,), generator=g).to(device),
        slots=torch.randperm(num_slots, generator=g)[:t].to(device),
        cos=emb.cos_table.to(device),
        sin=emb.sin_table.to(device),
        k_cache=_randn(num_slots, hk, d, dtype=cache_dtype, device=device, seed=seed + 3),
        v_cache=_randn(num_slots, hk, d, dtype=cache_dtype, device=device, seed=seed + 4),
        q_weight=weights[0],
        k_weight=weights[1],
    )


def _unfused(c: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the layer runs with the fusion off: (q, k cache, v cache)."""
    from minisgl.kernels.norm import rms_norm
    from minisgl.kernels.rope import apply_rope
    from minisgl.kernels.store import store_kv

    q, k = c.q, c.k
    if c.q_weight is not None and c.k_weight is not None:
        q, k = rms_norm(q, c.q_weight, EPS), rms_norm(k, c.k_weight, EPS)
    q, k = apply_rope(c.positions, q, k, c.cos, c.sin)
    k_cache, v_cache = c.k_cache.clone(), c.v_cache.clone()
    store_kv(k_cache, v_cache, k, c.v, c.slots)
    return q, k_cache, v_cache


def _fused(c: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from minisgl.kernels.qk_rope_store import fused_qk_norm_rope_store

    k_cache, v_cache = c.k_cache.clone(), c.v_cache.clone()
    q = fused_qk_norm_rope_store(
        c.q, c.k, c.v, c.positions, c.cos, c.sin, k_cache, v_cache, c.slots,
        c.q_weight, c.k_weight, EPS,
    )  # fmt: skip
    return q, k_cache, v_cache


def _assert_same(c: Case, what: str) -> None:
    qkv_before = c.qkv.clone()
    q_ref, k_ref, v_ref = _unfused(c)
    q_out, k_out, v_out = _fused(c)
    assert q_out.shape == q_ref.shape and q_out.dtype == q_ref.dtype, what
    assert q_out.is_contiguous(), what
    assert torch.equal(q_out, q_ref), f"q differs: {what}"
    assert torch.equal(k_out, k_ref), f"k cache differs: {what}"
    assert torch.equal(v_out, v_ref), f"v cache differs: {what}"
    untouched = torch.ones(c.k_cache.shape[0], dtype=torch.bool, device=c.k_cache.device)
    untouched[c.slots] = False
    assert torch.equal(k_out[untouched], c.k_cache[untouched]), f"stray k write: {what}"
    assert torch.equal(v_out[untouched], c.v_cache[untouched]), f"stray v write: {what}"
    assert torch.equal(c.qkv, qkv_before), f"the QKV input was modified: {what}"


# ---- checks: each takes the device and raises on mismatch ----


def _grid(device: torch.device, dtype: torch.dtype) -> None:
    for norm in (True, False):
        for hq, hk in ((4, 2), (4, 4)):  # GQA 4:2 and MHA
            for d in (64, 128):
                for t in (1, 5, 17):
                    c = _case(device, dtype, t, hq, hk, d, norm)
                    _assert_same(c, f"{dtype} norm={norm} hq={hq} hk={hk} d={d} t={t}")


def check_matches_unfused_fp32(device: torch.device) -> None:
    _grid(device, F32)


def check_matches_unfused_bf16(device: torch.device) -> None:
    _grid(device, BF16)


def check_matches_unfused_fp16(device: torch.device) -> None:
    for norm in (True, False):
        _assert_same(_case(device, F16, 9, 8, 2, 128, norm), f"fp16 norm={norm}")


def check_wide_and_odd_shapes(device: torch.device) -> None:
    """More heads than one tile (several chunks per token), MQA, a head_dim that is not a
    power of two (padded tiles), and the other RoPE schedules."""
    yarn = RopeConfig(theta=1e6, scaling_type="yarn", scaling=(("factor", 4.0),), max_position=64)
    llama3 = RopeConfig(theta=5e5, scaling_type="llama3", scaling=(("factor", 8.0),))
    cases = [(3, 40, 8, 128, yarn), (4, 6, 1, 80, llama3), (2, 2, 2, 32, None)]
    for dtype in (F32, BF16):
        for norm in (True, False):
            for t, hq, hk, d, rope in cases:
                c = _case(device, dtype, t, hq, hk, d, norm, rope)
                _assert_same(c, f"{dtype} norm={norm} hq={hq} hk={hk} d={d}")


def check_cache_dtype_cast(device: torch.device) -> None:
    """A pool of another dtype gets the same cast store_kv applies."""
    _assert_same(_case(device, BF16, 5, 4, 2, 64, True, cache_dtype=F32), "bf16 into fp32")


def check_fp8_cache(device: torch.device) -> None:
    """An fp8 pool (--kv-cache-dtype): the fused kernel writes the bytes store_kv writes
    (compared as bytes: torch.equal has no fp8 kernel on the CPU), and V's bytes are the
    torch pool's saturating cast (kvcache/kv_dtype.py); some values lie past e4m3's max."""
    from minisgl.kvcache.kv_dtype import to_kv_dtype

    def raw(x: torch.Tensor) -> torch.Tensor:
        return x.view(torch.uint8)

    for cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for dtype in (F32, BF16):
            for norm in (True, False):
                what = f"{dtype} into {cache_dtype} norm={norm}"
                c = _case(device, dtype, 7, 4, 2, 64, norm, cache_dtype=cache_dtype)
                c.v.mul_(100)  # past e4m3's max (a view of the QKV input; q/k stay normed)
                q_ref, k_ref, v_ref = _unfused(c)
                q_out, k_out, v_out = _fused(c)
                # Compiled for an fp8 cache, the kernel's float32 norm/RoPE may round q and k
                # an ulp apart from the unfused kernels' (bf16 is bit-equal; the GPU showed
                # it for float32): k may then land on the neighbouring fp8 value.
                torch.testing.assert_close(q_out, q_ref, rtol=1e-6, atol=1e-6, msg=what)
                codes = (raw(k_out).int() - raw(k_ref).int()).abs()
                assert int(codes.max()) <= 1 and float((codes > 0).float().mean()) < 0.01, what
                if dtype == BF16:
                    assert torch.equal(q_out, q_ref), what
                    assert torch.equal(raw(k_out), raw(k_ref)), f"k cache differs: {what}"
                assert torch.equal(raw(v_out), raw(v_ref)), f"v cache differs: {what}"
                v_want = to_kv_dtype(c.v, cache_dtype)
                assert torch.equal(raw(v_out[c.slots]), raw(v_want)), what
                assert c.v.abs().max() > 448 and v_out.float().abs().max() <= 57344, what
                untouched = torch.ones(c.k_cache.shape[0], dtype=torch.bool, device=device)
                untouched[c.slots] = False
                assert torch.equal(raw(k_out[untouched]), raw(c.k_cache[untouched])), what


def check_int32_indices(device: torch.device) -> None:
    c = _case(device, BF16, 5, 4, 2, 64, True)
    c.positions, c.slots = c.positions.int(), c.slots.int()
    _assert_same(c, "int32 positions and slots")


def check_empty(device: torch.device) -> None:
    from minisgl.kernels.qk_rope_store import fused_qk_norm_rope_store

    for norm in (True, False):
        c = _case(device, BF16, 0, 4, 2, 64, norm)
        k_cache, v_cache = c.k_cache.clone(), c.v_cache.clone()
        q = fused_qk_norm_rope_store(
            c.q, c.k, c.v, c.positions, c.cos, c.sin, k_cache, v_cache, c.slots,
            c.q_weight, c.k_weight, EPS,
        )  # fmt: skip
        assert q.shape == (0, 4, 64) and q.dtype == BF16
        assert torch.equal(k_cache, c.k_cache) and torch.equal(v_cache, c.v_cache)


def check_layer_uses_fused_path(device: torch.device) -> None:
    """SelfAttention with a backend that wants K/V stored by the layer: the same attention
    output and cache as with the unfused layer (on the CPU that one runs the torch norm and
    RoPE, so the comparison is close rather than equal; on CUDA it is exact)."""
    from minisgl.attention.base import BatchLayout, ForwardBatch
    from minisgl.attention.triton_backend import TritonBackend
    from minisgl.distributed import TPInfo
    from minisgl.kvcache.pool import KVPool
    from minisgl.layers.attention import SelfAttention
    from minisgl.models.config import ModelConfig

    cfg = ModelConfig.from_dict(
        dict(
            model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=64,
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=EPS,
        )
    )  # fmt: skip
    assert cfg.qk_norm, "the case needs q/k norm"
    torch.manual_seed(0)
    rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, 256).to(device)
    layer = SelfAttention(cfg, 1, rotary, TPInfo()).to(device)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.2)
    # Two requests extending cached prefixes: rows 0 and 1 of the page table.
    prefix, ext = [3, 0], [4, 2]
    table = torch.arange(2 * 16, device=device).view(2, 16)
    layout = BatchLayout([0, 1], prefix, ext, table)
    slots = torch.cat([table[r, p : p + e] for r, (p, e) in enumerate(zip(prefix, ext))])
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, ext)]).to(device)
    x = _randn(sum(ext), cfg.hidden_size, dtype=F32, device=device, seed=5)
    outs, pools = [], []
    initial = _randn(2, cfg.num_layers, 33, 2, cfg.head_dim, dtype=F32, device=device, seed=6)
    for fused in (False, True):
        pool = KVPool(cfg.num_layers, 33, 1, 2, cfg.head_dim, F32, device)
        pool.buffer.copy_(initial)
        backend = TritonBackend(pool, fused_kv_store=fused)
        md = backend.prepare(layout, device)
        batch = ForwardBatch(x.new_zeros(len(slots), dtype=torch.long), positions, slots,
                             backend, md, torch.arange(len(slots), device=device))  # fmt: skip
        with torch.inference_mode():
            outs.append(layer(x, batch))
        pools.append(pool.buffer)
    exact = device.type == "cuda"
    for a, b in ((outs[0], outs[1]), (pools[0], pools[1])):
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.equal(pools[1][:, 0], initial[:, 0]), "layer 0's cache must be untouched"
    assert not torch.equal(pools[1][:, 1], initial[:, 1]), "layer 1's K/V were not stored"


CHECKS = kernel_checks.collect(globals())


test_interpreted, test_on_gpu = kernel_checks.make_tests(
    __file__, CHECKS, slow=("matches_unfused_bf16",)
)


if __name__ == "__main__":
    kernel_checks.main(CHECKS)
