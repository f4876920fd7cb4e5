"""HiCache on the GPU (run through the device tool: `python -m pytest tests/gpu/test_hicache_gpu.py
-m gpu`): the host tier is pinned, loads run on a side stream layer by layer, and attention
waits on each layer's event.

The copy stream is made to lag (``torch.cuda._sleep`` on it before every load's copies), so
a layer read before its event would read the stale K/V of a reused page: greedy tokens (fp32)
must still equal HiCache off, with overlap scheduling and CUDA graphs on. Written with the
feature in a session without a GPU: not yet run.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl import LLM, SamplingParams
from tests.helpers import assert_engine_clean, make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

LAG_CYCLES = 5 * 10**7
OPTIONS: dict[str, Any] = dict(device="cuda", dtype="float32", num_pages=160)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("hicache") / "llama", "llama")


def conversations(llm: LLM) -> list[list[int]]:
    rng = random.Random(0)
    history = [[rng.randrange(3, 256) for _ in range(80)] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tokens: list[list[int]] = []
    for _ in range(3):
        for h, r in zip(history, llm.generate(history, params)):
            tokens.append(r["token_ids"])
            h += r["token_ids"] + [rng.randrange(3, 256) for _ in range(6)]
    return tokens


def _lag_loads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every load's copies start after a device sleep on the copy stream; returns a list
    that grows by one per load."""
    from minisgl.extensions.hicache.host_tier import HostTier

    original = HostTier._load_layers
    loads: list[int] = []

    def lagging(self: HostTier, src: torch.Tensor, dst: torch.Tensor, stream: Any) -> None:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(LAG_CYCLES)  # type: ignore[attr-defined]
        loads.append(dst.numel())
        original(self, src, dst, stream)

    monkeypatch.setattr(HostTier, "_load_layers", lagging)
    return loads


@pytest.mark.parametrize("graphs", [True, False])
def test_lagging_copy_stream_gives_identical_tokens(
    tiny: Path, monkeypatch: pytest.MonkeyPatch, graphs: bool
) -> None:
    graph_options = {} if graphs else dict(cuda_graph_max_bs=0)
    reference = conversations(LLM(str(tiny), **OPTIONS, **graph_options))
    loads = _lag_loads(monkeypatch)
    llm = LLM(str(tiny), hicache_size=0.01, **OPTIONS, **graph_options)
    assert llm.scheduler.kv.tier is not None and llm.scheduler.kv.tier.buffer.is_pinned()
    waited: list[int] = []
    pool = llm.engine.pool
    original_wait = pool.wait_layer

    def wait_layer(layer: int) -> None:
        waited.append(layer)
        original_wait(layer)

    monkeypatch.setattr(pool, "wait_layer", wait_layer)
    assert conversations(llm) == reference
    torch.cuda.synchronize()
    assert loads, "the workload was meant to load prefixes back from the host"
    assert pool.layer_events is not None and len(pool.layer_events) == pool.num_layers
    if not graphs:  # eager steps wait layer by layer, in order, before each attention
        assert waited[: pool.num_layers] == list(range(pool.num_layers))
    assert_engine_clean(llm)
