"""GPU checks for the fused Triton MoE (run through the device tool: pytest tests/gpu -m gpu).

The interpreter checks of tests/unit/kernels/test_moe.py on CUDA (plus the no-host-sync check),
the fused kernel against the torch reference at Qwen3-30B-A3B sizes, replay inside a CUDA
graph, and a tiny Qwen3-MoE equal to transformers on the GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.layers.moe import moe_reference
from tests.helpers import assert_engine_clean, make_tiny_model
from tests.kernel_checks import Skip
from tests.unit.kernels.test_moe import CHECKS, moe_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
CUDA = torch.device("cuda")


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_kernel_checks_on_gpu(name: str) -> None:
    try:
        CHECKS[name](CUDA)
    except Skip as e:
        pytest.skip(str(e))


def _cuda_case(
    t: int, e: int, k: int, h: int, i: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, ...]:
    """As test_moe.moe_case, generated on the GPU: CPU randn of 1.2G weights is slow."""
    from minisgl.layers.moe import select_experts

    g = torch.Generator(device=CUDA).manual_seed(seed)
    x = torch.randn(t, h, generator=g, device=CUDA)
    w13 = torch.randn(e, 2 * i, h, generator=g, device=CUDA) / h**0.5
    w2 = torch.randn(e, h, i, generator=g, device=CUDA) / i**0.5
    w, ids = select_experts(torch.randn(t, e, generator=g, device=CUDA), k, renormalize=True)
    return x.to(dtype), w13.to(dtype), w2.to(dtype), w.to(dtype), ids


# (experts, top_k, hidden, moe_intermediate per rank): Qwen3-30B-A3B at TP 1 and TP 4.
@pytest.mark.parametrize("e,k,h,i", [(128, 8, 2048, 768), (128, 8, 2048, 192)])
@pytest.mark.parametrize("tokens", [1, 7, 64, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_matches_reference_at_scale(
    e: int, k: int, h: int, i: int, tokens: int, dtype: torch.dtype
) -> None:
    from minisgl.kernels.moe import fused_moe

    x, w13, w2, w, ids = _cuda_case(tokens, e, k, h, i, dtype, seed=tokens)
    out = fused_moe(x, w13, w2, w, ids)
    ref = moe_reference(x, w13, w2, w, ids)
    # bf16: both round each matmul output to bf16; fp32 tiles accumulate in another order.
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_fused_moe_replays_in_cuda_graph() -> None:
    from minisgl.kernels.moe import fused_moe

    static = moe_case(24, 16, 4, 256, 128, torch.bfloat16, CUDA, seed=0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm the allocator outside capture
        fused_moe(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(*static)
    fresh = moe_case(24, 16, 4, 256, 128, torch.bfloat16, CUDA, seed=1)
    for buf, new in zip(static, fresh, strict=True):
        buf.copy_(new)  # new activations, weights and routing into the captured buffers
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_moe(*fresh))


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("gpu_moe") / "m", "qwen3_moe", max_position_embeddings=2048
    )


def test_tiny_moe_matches_hf_on_gpu_fp32(tiny_moe: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompts = [[5, 6, 7], list(range(10, 90)), [42] * 17, [100, 101]]
    hf = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).cuda().eval()
    ref = []
    for ids in prompts:
        g = hf.generate(
            torch.tensor([ids], device="cuda"),
            max_new_tokens=24,
            min_new_tokens=24,
            do_sample=False,
            pad_token_id=0,
        )
        ref.append(g[0, len(ids) :].tolist())
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for opts in ({"cuda_graph_max_bs": 0}, {}):  # eager, then decode in CUDA graphs
        llm = LLM(str(tiny_moe), dtype="float32", **opts)
        assert [r["token_ids"] for r in llm.generate(prompts, params)] == ref, opts
        assert_engine_clean(llm)


def test_tiny_moe_bf16_graphs_identical(tiny_moe: Path) -> None:
    prompts = [[5, 6, 7], list(range(10, 90)), [42] * 17, [100, 101], list(range(3, 40))]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = []
    for opts in ({"cuda_graph_max_bs": 0, "disable_overlap_scheduling": True}, {}):
        llm = LLM(str(tiny_moe), **opts)
        outs.append([r["token_ids"] for r in llm.generate(prompts, params)])
        assert_engine_clean(llm)
    assert outs[0] == outs[1]
