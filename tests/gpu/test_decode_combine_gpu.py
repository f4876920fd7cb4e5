"""Split decode rows combined in the split kernel (run through the device tool: `python -m
pytest tests/gpu -m gpu`): each row and KV head's last program, found by an atomic count,
combines the chunks the other programs wrote. That is a hand-off between programs of one
launch, so it is checked natively, many launches over, against the reduction kernel (bit
for bit), with PDL as the engine runs it, and end to end (greedy tokens, switch on = off)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl import LLM, env
from tests.helpers import assert_engine_clean, make_tiny_model
from tests.workloads import shared_prefix_workload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize(("hq", "block_n"), [(16, 64), (32, 32)])
def test_in_kernel_combine_equals_the_reduction_kernel_every_launch(hq: int, block_n: int) -> None:
    from minisgl.attention.triton_plan import plan_decode_splits
    from minisgl.kernels.decode_attention import decode_attention

    hk, d, pool = 8, 128, 20000
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(pool, hk, d, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(pool, hk, d, device="cuda", generator=g).to(torch.bfloat16)
    count = torch.zeros(64, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for trial in range(60):
        batch = (1, 2, 4, 3)[trial % 4]
        lens = torch.randint(1, 3000, (batch,), generator=g, device="cuda").tolist()
        table = torch.randint(0, pool, (batch, max(lens)), generator=g, device="cuda")
        table = table.to(torch.int32)
        rows = torch.arange(batch, device="cuda", dtype=torch.int32)
        seq = torch.tensor(lens, device="cuda", dtype=torch.int32)
        plan = plan_decode_splits(lens, hk, sms, 16, 64, block_n)
        splits = torch.tensor(plan, device="cuda", dtype=torch.int32)
        q = torch.randn(batch, hq, d, device="cuda", generator=g).to(torch.bfloat16)
        args = (q, k, v, table, rows, seq, splits, 16, d**-0.5)
        ref = decode_attention(*args, block_n=block_n, num_stages=1)
        got = decode_attention(*args, block_n=block_n, num_stages=1, count=count)
        assert torch.equal(got, ref), (trial, lens, plan, (got.float() - ref.float()).abs().max())
        assert not count.any(), (trial, "a launch left its count behind")


def test_combine_switch_on_off_identical(tmp_path: Path) -> None:
    """bf16, graphs and overlap, batches of 1-3 rows (split decode): the same greedy tokens
    with the chunks combined in the kernel (default) as with the reduction kernel."""
    tiny = make_tiny_model(tmp_path / "qwen3", "qwen3", max_position_embeddings=2048)
    prompts, params = shared_prefix_workload(3, 24, 300, 200, 64)
    outs = []
    for flag in (False, True):
        with env.override({env.FUSED_DECODE_REDUCE: flag}):
            llm = LLM(str(tiny), max_running_requests=3)
            assert (llm.engine.attn_backend._count is not None) == flag  # type: ignore[attr-defined]
            outs.append([r["token_ids"] for r in llm.generate(prompts, params)])
            assert_engine_clean(llm)
    assert outs[0] == outs[1]
