"""TritonBackend against the TorchBackend reference on small paged batches.

Without CUDA the kernels run in Triton's interpreter. Triton picks interpreter or compiler
as each @triton.jit decorator runs, its own library functions included, so TRITON_INTERPRET
must be set before triton is first imported. If another test module imported triton first,
this process cannot interpret; each test then reports its result from one pytest
subprocess that runs this file with the variable set.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

_ON_GPU = torch.cuda.is_available()
_CHILD_FLAG = "TEST_TRITON_ATTENTION_CHILD"
if not _ON_GPU and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from minisgl.attention.base import BatchLayout  # noqa: E402
from minisgl.attention.torch_backend import TorchBackend  # noqa: E402
from minisgl.attention.triton_backend import TritonBackend  # noqa: E402
from minisgl.attention.triton_plan import plan_decode_splits  # noqa: E402
from minisgl.kernels import attention as attention_kernels  # noqa: E402
from minisgl.kernels.store import store_kv  # noqa: E402
from minisgl.kvcache.pool import KVPool  # noqa: E402

_JIT = triton.runtime.jit.JITFunction
# Compiled-mode jit functions (ours or triton.language's own) cannot run on a CPU.
_IN_PROCESS = _ON_GPU or not any(
    isinstance(f, _JIT) for f in (attention_kernels._extend_kernel, triton.language.zeros)
)
assert _IN_PROCESS or not os.environ.get(_CHILD_FLAG), "child could not enable the interpreter"


@functools.cache
def _child_results() -> dict[str, tuple[str, str]]:
    """Run this file once under a fresh interpreter-mode pytest; test name -> outcome, text."""
    with tempfile.TemporaryDirectory() as tmp:
        xml_path = Path(tmp) / "report.xml"
        env = {**os.environ, "TRITON_INTERPRET": "1", _CHILD_FLAG: "1"}
        cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider",
               "-o", "addopts=", f"--junitxml={xml_path}"]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if not xml_path.exists():
            return {"": ("error", proc.stdout[-4000:] + proc.stderr[-4000:])}
        results = {}
        for case in ET.parse(xml_path).getroot().iter("testcase"):
            outcome, text = "passed", ""
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome, text = child.tag, child.get("message", "") + "\n" + (child.text or "")
            results[case.get("name", "")] = (outcome, text)
        return results


def interpreted(test: Callable[..., None]) -> Callable[..., None]:
    """Run the test here when this process can execute the kernels, else in the child."""
    if _IN_PROCESS:
        return test

    @functools.wraps(test)
    def from_child(*args: object, **kwargs: object) -> None:
        # "path::name[@group] (call)": xdist's loadgroup appends the group to the node id.
        name = os.environ["PYTEST_CURRENT_TEST"].split("::")[-1].rsplit(" ", 1)[0]
        name = name.split("@", 1)[0]
        results = _child_results()
        outcome, text = results.get(name, results.get("", ("missing", f"{name} did not run")))
        if outcome == "skipped":
            pytest.skip(text)
        assert outcome == "passed", f"{outcome} in the interpreter subprocess:\n{text}"

    return from_child


DEVICE = torch.device("cuda" if _ON_GPU else "cpu")
LAYERS = 2


@dataclass
class World:
    pool: KVPool
    layout: BatchLayout
    out_slots: torch.Tensor


def make_world(
    prefix: list[int],
    ext: list[int],
    hk: int,
    d: int,
    page_size: int,
    dtype: torch.dtype,
    seed: int,
    pt_dtype: torch.dtype = torch.int64,
    kv_dtype: torch.dtype | None = None,
) -> World:
    """A pool full of random K/V, and a batch whose rows own shuffled, non-contiguous pages.
    The pool holds ``kv_dtype`` (default: ``dtype``; fp8 for --kv-cache-dtype)."""
    g = torch.Generator().manual_seed(seed)
    seq = [p + e for p, e in zip(prefix, ext, strict=True)]
    pages_per_row = [triton.cdiv(s, page_size) for s in seq]
    num_pages = sum(pages_per_row) + 3
    pool = KVPool(LAYERS, num_pages, page_size, hk, d, kv_dtype or dtype, DEVICE)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=g).to(dtype))
    width = max(seq) + 7
    # Unused entries hold valid-but-wrong slots: reading them unmasked would corrupt results.
    table = torch.randint(0, pool.num_slots, (len(seq) + 3, width), generator=g)
    rows = torch.randperm(len(seq) + 3, generator=g)[: len(seq)].tolist()
    perm = torch.randperm(num_pages, generator=g)
    used = 0
    for row, s, n in zip(rows, seq, pages_per_row, strict=True):
        pages = perm[used : used + n]
        used += n
        table[row, :s] = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:s]
    out_slots = torch.cat([table[r, p : p + e] for r, p, e in zip(rows, prefix, ext, strict=True)])
    table = table.to(pt_dtype).to(DEVICE)
    layout = BatchLayout(rows, list(prefix), list(ext), table)
    return World(pool, layout, out_slots.to(DEVICE))


def run_case(
    prefix: list[int],
    ext: list[int],
    hq: int,
    hk: int,
    d: int,
    page_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    fused_qkv: bool = False,
    pt_dtype: torch.dtype = torch.int64,
    backend_kw: dict[str, int] | None = None,
    kv_dtype: torch.dtype | None = None,
    scales: tuple[float, float] = (1.0, 1.0),
) -> TritonBackend:
    """``kv_dtype`` fp8: both backends store into and read from an fp8 pool (the reference
    one the torch backend's saturating cast), so only the kernels' arithmetic differs."""
    world = make_world(prefix, ext, hk, d, page_size, dtype, seed, pt_dtype, kv_dtype)
    ref_dtype = kv_dtype or torch.float32
    ref_pool = KVPool(LAYERS, world.pool.num_pages, page_size, hk, d, ref_dtype, DEVICE)
    ref_pool.buffer.copy_(world.pool.buffer if kv_dtype else world.pool.buffer.float())
    for pool in (world.pool, ref_pool):
        pool.k_scales, pool.v_scales = [scales[0]] * LAYERS, [scales[1]] * LAYERS
    g = torch.Generator().manual_seed(seed + 1)
    t = sum(ext)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(dtype).to(DEVICE)
    if fused_qkv:  # strided views, as a fused projection hands them over
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=1)
        q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)
    else:
        q = qkv[:, : hq * d].reshape(t, hq, d).contiguous()
        k = qkv[:, hq * d : (hq + hk) * d].reshape(t, hk, d).contiguous()
        v = qkv[:, (hq + hk) * d :].reshape(t, hk, d).contiguous()
    scale = d**-0.5
    layer = LAYERS - 1  # a non-zero layer checks the per-layer base pointers
    backend = TritonBackend(world.pool, **(backend_kw or {}))
    md = backend.prepare(world.layout, DEVICE)
    out = backend.forward(q, k, v, layer, world.out_slots, md, scale)
    # Reference in fp32 on the same (already rounded) values isolates the kernel's error.
    ref_backend = TorchBackend(ref_pool)
    ref_md = ref_backend.prepare(world.layout, DEVICE)
    ref = ref_backend.forward(
        q.float(), k.float(), v.float(), layer, world.out_slots, ref_md, scale
    )
    assert out.shape == (t, hq * d) and out.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    if kv_dtype is not None:  # bit for bit: store_kv rounds as the torch cast does
        assert torch.equal(world.pool.buffer.view(torch.uint8), ref_pool.buffer.view(torch.uint8))
    else:
        torch.testing.assert_close(world.pool.buffer.float(), ref_pool.buffer, atol=0, rtol=0)
    return backend


def splits_of(backend: TritonBackend, prefix: list[int], ext: list[int], hk: int) -> list[int]:
    world = make_world(prefix, ext, hk, 32, 1, torch.float32, 0)
    return backend.prepare(world.layout, DEVICE).num_splits.tolist()


SMALL_TILES = {"extend_block_m": 16, "extend_block_n": 16}
SMALL_SPLITS = {"min_split_tokens": 16, "mixed_split_tokens": 16, "decode_block_n": 16,
                "max_kv_splits": 4, "num_sms": 8}  # fmt: skip


@pytest.mark.parametrize(
    ("prefix", "ext", "hq", "hk", "d", "ps", "kw"),
    [
        ([0, 5, 20], [7, 1, 33], 4, 2, 64, 16, SMALL_TILES),  # mixed: one decode row
        ([0, 0], [17, 3], 4, 4, 32, 1, SMALL_TILES),  # plain prefill, MHA
        ([40], [24], 8, 1, 128, 1, SMALL_TILES),  # MQA, prefix not tile-aligned
        ([3, 31, 50], [18, 1, 2], 6, 2, 80, 16, SMALL_TILES),  # group 3, head_dim 80
        ([70, 0, 12], [9, 70, 1], 4, 2, 64, 16, {}),  # default 64-wide tiles
    ],
)
@interpreted
def test_extend_matches_reference(prefix, ext, hq, hk, d, ps, kw) -> None:
    run_case(prefix, ext, hq, hk, d, ps, backend_kw=kw)


@pytest.mark.parametrize(
    ("prefix", "hq", "hk", "d", "ps"),
    [
        ([37, 100, 3, 64], 4, 2, 64, 16),
        ([150, 20], 8, 1, 128, 1),
        ([0, 9, 47], 4, 4, 32, 1),  # a row whose only key is the new token
        ([33, 90], 6, 2, 80, 16),
    ],
)
@interpreted
def test_decode_matches_reference_with_splits(prefix, hq, hk, d, ps) -> None:
    ext = [1] * len(prefix)
    backend = run_case(prefix, ext, hq, hk, d, ps, backend_kw=SMALL_SPLITS)
    splits = splits_of(backend, prefix, ext, hk)
    assert max(splits) > 1, splits  # the split-KV path and its reduction really ran


@interpreted
def test_mixed_batch_one_token_rows_take_the_split_decode_kernel() -> None:
    # A prefill chunk beside decodes with long prefixes: the one-token rows go through the
    # decode kernel (gathered query tokens, split KV + reduction), the chunk through extend.
    prefix, ext = [0, 37, 100, 3, 150], [20, 1, 1, 1, 1]
    backend = run_case(prefix, ext, 4, 2, 64, 16, backend_kw={**SMALL_TILES, **SMALL_SPLITS})
    world = make_world(prefix, ext, 2, 32, 1, torch.float32, 0)
    md = backend.prepare(world.layout, DEVICE)
    assert md.dec_rows == 4 and md.dec_tokens.tolist() == [20, 21, 22, 23]
    assert max(md.num_splits.tolist()) > 1 and md.block_batch.tolist() == [0, 0]


@interpreted
def test_engine_greedy_equals_torch_backend_with_mixed_batches(
    tiny_models: dict[str, Path],
) -> None:
    """The whole engine on the Triton backend (interpreted on CPU): small prefill chunks and
    4 slots make mixed batches whose one-token rows take the decode kernel; greedy tokens
    equal the torch backend's."""
    import random

    from minisgl import LLM, SamplingParams

    model = tiny_models["qwen3"]  # a 512-token context
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(3, 60))] for _ in range(6)]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(5, 20), ignore_eos=True)
        for _ in prompts
    ]
    outs = []
    for backend in ("torch", "triton"):
        llm = LLM(str(model), attention_backend=backend, chunked_prefill_size=24,
                  max_running_requests=4)  # fmt: skip
        outs.append([r["token_ids"] for r in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]


@interpreted
def test_decode_default_plan() -> None:
    backend = run_case([600, 5], [1, 1], 4, 2, 64, 16)
    # 8 SMs on CPU: cap 8 splits, 32-token tiles; the 601-token row takes 7 chunks of 96.
    assert splits_of(backend, [600, 5], [1, 1], 2) == [7, 1]


@interpreted
def test_strided_qkv_and_int32_page_table() -> None:
    run_case(
        [9, 0], [5, 12], 4, 2, 64, 1, fused_qkv=True, pt_dtype=torch.int32, backend_kw=SMALL_TILES
    )
    run_case(
        [30, 41], [1, 1], 4, 2, 64, 1, fused_qkv=True, pt_dtype=torch.int32, backend_kw=SMALL_SPLITS
    )


@pytest.mark.parametrize("kind", ["extend", "decode"])
@interpreted
def test_bf16(kind: str) -> None:
    # In the interpreter, 16-bit tiles are upcast for tl.dot (see kernels/attention.py), so
    # this covers bf16 loads, casts and stores; the bf16 tensor-core dots run only on a GPU.
    if kind == "extend":
        run_case(
            [10, 0, 4], [30, 17, 1], 4, 2, 64, 16, dtype=torch.bfloat16, backend_kw=SMALL_TILES
        )
    else:
        run_case(
            [37, 100, 3], [1, 1, 1], 4, 2, 64, 16, dtype=torch.bfloat16, backend_kw=SMALL_SPLITS
        )


@interpreted
def test_decode_replay_with_new_lengths() -> None:
    """Graph-replay pattern: same batch size, new lengths written into the first batch's
    device tensors; the launch (grid, constants) is unchanged and results follow the data."""
    hq, hk, d, ps = 4, 2, 64, 16
    first = make_world([20, 5], [1, 1], hk, d, ps, torch.float32, 3)
    second = make_world([90, 40], [1, 1], hk, d, ps, torch.float32, 4)
    backend = TritonBackend(second.pool, **SMALL_SPLITS)
    md = backend.prepare(first.layout, DEVICE)
    new = backend.prepare(second.layout, DEVICE)
    assert md.num_splits.tolist() == [2, 1] and new.num_splits.tolist() == [3, 3]
    md.page_table = second.layout.page_table  # an engine has one table for all batches
    backend.refresh(md, second.layout, DEVICE)
    assert md.num_splits.tolist() == new.num_splits.tolist()
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, h, d, generator=g).to(DEVICE) for h in (hq, hk, hk))
    ref_pool = KVPool(LAYERS, second.pool.num_pages, ps, hk, d, torch.float32, DEVICE)
    ref_pool.buffer.copy_(second.pool.buffer)
    out = backend.forward(q, k, v, 0, second.out_slots, md, 0.125)
    ref_backend = TorchBackend(ref_pool)
    ref_md = ref_backend.prepare(second.layout, DEVICE)
    ref = ref_backend.forward(q, k, v, 0, second.out_slots, ref_md, 0.125)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@interpreted
def test_extend_graph_padding_replays_any_fitting_batch() -> None:
    """Prefill/mixed CUDA-graph pattern: metadata padded to a fixed row/tile capacity and
    tokens padded to a bucket (padding tokens write a scratch slot). Captured on one
    batch's metadata, refreshed with another's: real tokens' outputs equal the unpadded
    launch exactly, and the padding changes no KV slot but the scratch one."""
    hq, hk, d, ps = 4, 2, 64, 1
    world = make_world([0, 21, 7], [13, 1, 9], hk, d, ps, torch.float32, 5)
    other = make_world([3], [2], hk, d, ps, torch.float32, 6)
    tokens, rows = 32, 4
    backend = TritonBackend(world.pool, extend_block_m=16, extend_block_n=16)
    shape = backend.extend_graph_shape(tokens, rows)
    assert shape.block_m == 16 and shape.tiles == 2 + rows
    md = backend.prepare_extend_graph(other.layout, DEVICE, shape)  # "captured"
    md.page_table = world.layout.page_table
    backend.refresh(md, world.layout, DEVICE, shape)
    n = sum(world.layout.extend_lens)
    g = torch.Generator().manual_seed(11)
    q = torch.randn(tokens, hq, d, generator=g).to(DEVICE)
    k, v = (torch.randn(tokens, hk, d, generator=g).to(DEVICE) for _ in range(2))
    lay = world.layout
    used = {int(x) for r, sl in zip(lay.req_rows, lay.seq_lens) for x in lay.page_table[r, :sl]}
    scratch = min(set(range(world.pool.num_slots)) - used)  # a slot no row of the batch reads
    slots = torch.cat([world.out_slots, torch.full((tokens - n,), scratch, device=DEVICE)])
    before = world.pool.buffer.clone()
    out = backend.forward(q, k, v, 1, slots, md, 0.125)
    padded_pool = world.pool.buffer.clone()
    world.pool.buffer.copy_(before)
    ref = backend.forward(
        q[:n], k[:n], v[:n], 1, world.out_slots, backend.prepare(lay, DEVICE), 0.125
    )
    assert torch.equal(out[:n], ref)
    keep = torch.ones(world.pool.num_slots, dtype=torch.bool)
    keep[scratch] = False
    assert torch.equal(padded_pool[:, :, keep], world.pool.buffer[:, :, keep])


@interpreted
def test_store_kv_strided_wide_rows_and_cast() -> None:
    # Hk * D = 1280 > one program's 1024-wide block; fp32 source into a bf16 pool.
    t, hk, d = 5, 8, 160
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(t, 2 * hk * d, generator=g).to(DEVICE)
    k, v = (x.view(t, hk, d) for x in kv.split([hk * d, hk * d], dim=1))
    cache = torch.zeros(2, 11, hk, d, dtype=torch.bfloat16, device=DEVICE)
    slots = torch.tensor([7, 0, 10, 3, 4], device=DEVICE)
    store_kv(cache[0], cache[1], k, v, slots)
    expect = torch.zeros_like(cache)
    expect[0, slots] = k.to(torch.bfloat16)
    expect[1, slots] = v.to(torch.bfloat16)
    # The interpreter truncates fp32 -> bf16 where GPUs round to nearest: allow one ulp.
    torch.testing.assert_close(cache, expect, atol=0, rtol=2**-7)


def test_plan_decode_splits() -> None:
    # Big batch (128 x 8 programs >= 4 waves of 132 SMs): enough programs without splitting.
    assert plan_decode_splits([5000] * 128, 8, 132, 16, 64, 64) == [1] * 128
    # 64 rows: the grid may split in two; equal rows of 5000 tokens take both halves.
    assert plan_decode_splits([5000] * 64, 8, 132, 16, 64, 64) == [2] * 64
    # Chunks are sized from the batch's total KV, so the long row gets every split allowed
    # and the short ones stay whole (no program waits on a much longer one).
    assert plan_decode_splits([100_000, 300, 10], 8, 132, 16, 256, 64) == [16, 1, 1]
    assert plan_decode_splits([100_000], 1, 132, 16, 256, 64) == [16]
    # Batch 1 with a short context still spreads over the SMs, down to min_split_tokens.
    assert plan_decode_splits([228], 8, 132, 16, 64, 32) == [4]
    assert plan_decode_splits([0], 1, 132, 16, 256, 64) == [1]
    # The kernel's chunking (BLOCK_N-rounded) never leaves a planned chunk empty.
    for length in range(1, 400, 7):
        (n,) = plan_decode_splits([length], 1, 132, 16, 16, 64)
        chunk = triton.cdiv(triton.cdiv(length, n), 64) * 64
        assert (n - 1) * chunk < length <= n * chunk


def test_split_plans_do_not_change_when_a_graph_pads_the_batch() -> None:
    """A row's split plan (its chunks and the kernel's tile) fixes its rounding, so it must
    be the same eager and padded to a captured graph, or greedy tokens change with graphs
    off: decode batches are planned as their padded size, and a mixed batch's one-token
    rows each from their own length."""
    from minisgl.attention.base import padded_batch_size
    from minisgl.attention.triton_plan import ExtendGraphShape

    CPU = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    backend = TritonBackend(KVPool(1, 64, 1, 8, 64, torch.float32, CPU), num_sms=132)
    table = torch.zeros(600, 8, dtype=torch.int32)
    for b in (1, 3, 5, 9, 17, 33, 63, 65, 100, 300):
        prefix = torch.randint(1, 20_000, (b,), generator=gen).tolist()
        eager = backend.prepare(BatchLayout(list(range(b)), prefix, [1] * b, table), CPU)
        pad = padded_batch_size(b) - b  # the graph runner's padding rows: 0 + 1 token
        layout = BatchLayout(
            list(range(b)) + [599] * pad, prefix + [0] * pad, [1] * (b + pad), table
        )
        graph = backend.prepare(layout, CPU)
        assert eager.max_splits == graph.max_splits, b
        assert eager.num_splits.tolist() == graph.num_splits[:b].tolist(), b
        # The same one-token rows beside a prefill chunk, eager and in a padded mixed graph.
        mixed = BatchLayout(list(range(b + 1)), prefix + [0], [1] * b + [40], table)
        eager = backend.prepare(mixed, CPU)
        shape = ExtendGraphShape(rows=512, tiles=600, block_m=64)
        graph = backend.prepare_extend_graph(mixed, CPU, shape)
        assert eager.max_splits == graph.max_splits and eager.dec_rows == b
        assert eager.num_splits.tolist() == graph.num_splits[:b].tolist(), b
        assert set(graph.num_splits[b:].tolist()) == {0}  # padding rows do no work
        alone = [backend.prepare(BatchLayout([i, b], [n, 0], [1, 40], table), CPU)
                 for i, n in enumerate(prefix[:3])]  # fmt: skip
        assert [md.num_splits[0].item() for md in alone] == eager.num_splits[:3].tolist()


def test_graph_sizes_are_the_padded_batch_sizes() -> None:
    """A decode batch of n rows replays the graph of padded_batch_size(n) rows, the size its
    split plan is made for (graphs on or off)."""
    from minisgl.attention.base import padded_batch_size
    from minisgl.engine.cuda_graph import graph_batch_sizes

    assert [padded_batch_size(n) for n in (1, 2, 3, 5, 9, 63, 65, 80, 81)] == [
        1, 2, 4, 8, 16, 64, 80, 80, 96,
    ]  # fmt: skip
    for max_bs in (1, 7, 100, 256):
        sizes = graph_batch_sizes(max_bs)
        for n in range(1, max_bs + 1):
            assert next(s for s in sizes if s >= n) == padded_batch_size(n)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize(
    ("prefix", "ext", "hq", "hk", "d", "ps", "kw"),
    [
        ([0, 5, 20], [7, 1, 33], 4, 2, 64, 16, SMALL_TILES),  # mixed: a decode row, GQA
        ([40, 0], [24, 17], 8, 1, 128, 1, SMALL_TILES),  # MQA, prefix + extend, page 1
        ([37, 100, 3, 64], [1, 1, 1, 1], 4, 2, 64, 16, SMALL_SPLITS),  # split decode
        ([150, 20], [1, 1], 8, 2, 128, 1, SMALL_SPLITS),  # split decode, page 1
        ([0, 37, 100, 3], [20, 1, 1, 1], 4, 2, 64, 16, {**SMALL_TILES, **SMALL_SPLITS}),
    ],
)
@interpreted
def test_fp8_pool_matches_reference(prefix, ext, hq, hk, d, ps, kw, kv_dtype) -> None:
    backend = run_case(prefix, ext, hq, hk, d, ps, backend_kw=kw, kv_dtype=kv_dtype)
    if all(e == 1 for e in ext) or kw.get("max_kv_splits"):
        world = make_world(prefix, ext, hk, 32, 1, torch.float32, 0)
        assert max(backend.prepare(world.layout, DEVICE).num_splits.tolist()) > 1


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@interpreted
def test_fp8_pool_bf16_queries(kv_dtype: torch.dtype) -> None:
    # bf16 compute over an fp8 pool: the kernels upcast the loaded fp8 tiles to q's dtype.
    run_case([10, 0, 4], [30, 17, 1], 4, 2, 64, 16, dtype=torch.bfloat16,
             backend_kw=SMALL_TILES, kv_dtype=kv_dtype)  # fmt: skip
    run_case([37, 100, 3], [1, 1, 1], 4, 2, 64, 16, dtype=torch.bfloat16,
             backend_kw=SMALL_SPLITS, kv_dtype=kv_dtype)  # fmt: skip


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@interpreted
def test_store_kv_fp8_rounds_and_saturates_as_torch(kv_dtype: torch.dtype, src) -> None:
    """store_kv into an fp8 cache equals the pool's torch cast (kv_dtype.to_kv_dtype) bit for
    bit: on every fp8 value, every midpoint between neighbours (ties to even) and just
    below it, values of all magnitudes (subnormals included), past the max, and -0."""
    from minisgl.kvcache.kv_dtype import to_kv_dtype

    grid = torch.arange(256, dtype=torch.uint8).view(kv_dtype).float()
    grid = grid[grid.isfinite()].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    scales = torch.exp2(torch.randint(-22, 18, (2000,), generator=g).float())
    rnd = torch.randn(2000, generator=g) * scales
    edge = torch.tensor([448.0, 449.0, 464.0, 480.0, 1e5, 57344.0, 6e4, 1e30, -1e30, -0.0])
    x = torch.cat([grid, mids, mids.nextafter(torch.zeros(())), rnd, edge])
    row = 2 * 32
    x = torch.cat([x, torch.zeros(-x.numel() % row)]).view(-1, 2, 32).to(src).to(DEVICE)
    n = x.shape[0]
    cache = torch.zeros(2, n + 3, 2, 32, dtype=kv_dtype, device=DEVICE)
    slots = torch.randperm(n + 3, generator=g)[:n].to(DEVICE)
    store_kv(cache[0], cache[1], x, -x, slots)
    for got, want in ((cache[0, slots], to_kv_dtype(x, kv_dtype)),
                      (cache[1, slots], to_kv_dtype(-x, kv_dtype))):  # fmt: skip
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", [0, 1, 2, 3])
@interpreted
def test_fp8_modes_and_scales(kv_dtype: torch.dtype, mode: int) -> None:
    """Every fp8 conversion mode (kernels/fp8_kv.py) under bf16 queries, with per-tensor
    scales (powers of two: the torch store's division and the kernel's multiply by the
    inverse round alike): extend, mixed and split decode batches against the reference."""
    for scales in ((1.0, 1.0), (0.25, 4.0)):
        kw: dict[str, int] = {**SMALL_TILES, "fp8_mode": mode}
        run_case([10, 0, 4], [30, 17, 1], 4, 2, 64, 16, dtype=torch.bfloat16,
                 backend_kw=kw, kv_dtype=kv_dtype, scales=scales)  # fmt: skip
        kw = {**SMALL_SPLITS, "fp8_mode": mode}
        run_case([37, 100, 3], [1, 1, 1], 4, 2, 64, 16, dtype=torch.bfloat16,
                 backend_kw=kw, kv_dtype=kv_dtype, scales=scales)  # fmt: skip
