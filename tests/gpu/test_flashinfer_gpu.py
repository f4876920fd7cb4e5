"""The FlashInfer backend on the GPU (skipped where flashinfer is not installed): attention
equal to the torch reference up to bf16 rounding for decode, prefill over a cached prefix
and mixed batches on shuffled slots; an engine on it serves the shared-prefix workload
(radix cache, chunked prefill, mixed batches, page 16) and leaves the pool clean."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.attention.base import BatchLayout
from minisgl.attention.torch_backend import TorchBackend
from minisgl.kvcache.pool import KVPool
from tests.helpers import assert_engine_clean, make_tiny_model
from tests.workloads import shared_prefix_workload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
flashinfer = pytest.importorskip("flashinfer")


@pytest.mark.parametrize(
    "prefix,ext",
    [
        ([5, 300, 17, 1000], [1, 1, 1, 1]),  # decode
        ([0, 40, 0], [33, 70, 5]),  # prefill, one over a cached prefix
        ([9, 0, 300, 4], [1, 130, 1, 6]),  # mixed: decodes beside chunks
    ],
    ids=["decode", "prefill", "mixed"],
)
def test_attention_matches_torch_reference(prefix: list[int], ext: list[int]) -> None:
    from minisgl.extensions.flashinfer.backend import FlashInferBackend

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    hq, hk, d = 16, 8, 128
    seq = [p + e for p, e in zip(prefix, ext)]
    pool = KVPool(2, sum(seq) + 8, 1, hk, d, torch.bfloat16, dev)
    pool.buffer.normal_(generator=g)
    table = torch.zeros(len(seq) + 1, max(seq) + 1, dtype=torch.long, device=dev)
    perm = torch.randperm(pool.num_slots - 8, generator=g, device=dev)
    used = 0
    for r, s in enumerate(seq):
        table[r + 1, :s] = perm[used : used + s]
        used += s
    layout = BatchLayout(list(range(1, len(seq) + 1)), prefix, ext, table)
    tokens = sum(ext)
    q = torch.randn(tokens, hq, d, generator=g, device=dev, dtype=torch.bfloat16)
    k = torch.randn(tokens, hk, d, generator=g, device=dev, dtype=torch.bfloat16)
    v = torch.randn(tokens, hk, d, generator=g, device=dev, dtype=torch.bfloat16)
    slots = torch.cat([table[r + 1, p : p + e] for r, (p, e) in enumerate(zip(prefix, ext))])
    outs = []
    for backend in (TorchBackend(pool), FlashInferBackend(pool, dev)):
        md = backend.prepare(layout, dev)
        outs.append(backend.forward(q, k, v, 1, slots, md, d**-0.5).float())
    torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=2e-2)


def test_engine_on_flashinfer_serves_the_workload(tmp_path: Path) -> None:
    # head_dim 64: FlashInfer's prefill kernels have no configuration for the tiny default 32
    # (seen on the H200: "Invalid configuration : NUM_MMA_D_QK=2"); the backend refuses it.
    tiny = make_tiny_model(tmp_path / "qwen3", "qwen3", max_position_embeddings=2048, head_dim=64)
    prompts, params = shared_prefix_workload(3, 24, 300, 200, 64)
    ref = LLM(str(tiny), cuda_graph_max_bs=0, disable_overlap_scheduling=True)
    want = [r["token_ids"] for r in ref.generate(prompts, params)]
    # Another kernel, other bf16 rounding: one near-tie flips the rest of a free-running
    # sequence (seen on the H200: 697 of 909 tokens equal position by position, every first
    # token equal). So the check is teacher-forced: each prompt extended by the reference's
    # own tokens up to a cut, two tokens generated (the first through the paged prefill over
    # a cached prefix, the second through the decode kernel), compared with the reference's.
    cuts = (0, 9, 31, 62)
    pairs = [(p, w, c) for p, w in zip(prompts, want) for c in cuts if c + 2 <= len(w)]
    forced = [p + w[:c] for p, w, c in pairs]
    expect = [w[c : c + 2] for _, w, c in pairs]
    two = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for options in (dict(), dict(page_size=16, chunked_prefill_size=64)):
        llm = LLM(str(tiny), attention_backend="flashinfer", **options)  # type: ignore[arg-type]
        got = [r["token_ids"] for r in llm.generate(forced, two)]
        assert_engine_clean(llm)
        for step in (0, 1):
            same = sum(g[step] == e[step] for g, e in zip(got, expect))
            assert same >= 0.95 * len(expect), (options, step, same, len(expect))
