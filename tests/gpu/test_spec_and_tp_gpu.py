"""GPU checks for speculative decoding and tensor parallelism (device tool:
`python -m pytest tests/gpu -m gpu`; the TP test needs two GPUs and skips otherwise).

Speculation (n-gram and a draft model, whose decodes replay CUDA graphs) must leave greedy
outputs unchanged with graphs and overlap on; TP=2 over NCCL must equal TP=1 with graphs and
overlap on.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams
from tests.helpers import assert_engine_clean, make_tiny_model, perturbed_copy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu_spec")
    target = make_tiny_model(root / "target", "qwen3", max_position_embeddings=2048)
    return {"target": target, "draft": perturbed_copy(target, root / "draft", scale=0.01)}


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(5)
    motif = [rng.randrange(3, 256) for _ in range(12)]
    prompts = []
    for i in range(16):
        body = motif * rng.randint(2, 6) if i % 2 else [rng.randrange(3, 256) for _ in range(40)]
        prompts.append(body + [rng.randrange(3, 256) for _ in range(rng.randint(1, 30))])
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(8, 48), ignore_eos=True)
        for _ in prompts
    ]
    return prompts, params


def _greedy(path: Path, **options: object) -> list[list[int]]:
    prompts, params = _workload()
    options.setdefault("dtype", "float32")
    llm = LLM(str(path), **options)  # type: ignore[arg-type]
    out = [r["token_ids"] for r in llm.generate(prompts, params)]
    assert_engine_clean(llm)
    return out


@pytest.mark.parametrize(
    "spec",
    [
        {"speculative_algorithm": "ngram"},
        {"speculative_draft_model": "draft"},
        {"speculative_draft_model": "target"},
    ],
    ids=["ngram", "draft-model", "same-model-draft"],
)
def test_speculation_keeps_greedy_outputs_on_gpu(
    models: dict[str, Path], spec: dict[str, str]
) -> None:
    ref = _greedy(models["target"])
    options: dict[str, object] = dict(spec)
    if "speculative_draft_model" in options:
        options["speculative_draft_model"] = str(models[spec["speculative_draft_model"]])
    assert _greedy(models["target"], **options) == ref


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp2_equals_tp1_with_graphs_and_overlap(models: dict[str, Path]) -> None:
    ref = _greedy(models["target"])
    assert _greedy(models["target"], tp_size=2) == ref


_PEER_RUN = """
import json, sys
from minisgl import LLM
from minisgl.distributed.reducer import active_reducer
from tests.gpu.test_spec_and_tp_gpu import _workload
prompts, params = _workload()
llm = LLM(sys.argv[1], tp_size=2, dtype="bfloat16")
peer = active_reducer()
out = [r["token_ids"] for r in llm.generate(prompts, params)]
# Calls of the fused all-reduce + norm kernel (per program: its epoch counter).
fused = int(peer.norm_epochs.sum()) if peer is not None and peer.fuse_norm else 0
pushes = peer.pushes if fused else 0  # batch-1 GEMVs that pushed their rows (host calls)
# Every slot the peer wrote was read and reset, and nothing else was written: rank 0's
# buffer is all sentinel bytes again once the GPU is idle.
import torch
torch.cuda.synchronize()
clean = bool(peer.norm_buf.eq(0xFF).all()) if fused else True
llm.close()
print(json.dumps({"peer": peer is not None, "fused": fused, "pushes": pushes, "clean": clean,
                  "out": out}))
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize(("fused_norm", "gemv_push"), [("1", "1"), ("1", "0"), ("0", "0")])
def test_tp2_peer_all_reduce_matches_nccl_bf16(
    models: dict[str, Path], fused_norm: str, gemv_push: str
) -> None:
    """bf16 (the CUDA default): all-reduces through GPU peer memory, fused with the norm
    that follows them or not (the FUSED_ALL_REDUCE_NORM switch), their rows pushed by the
    batch-1 GEMV before them or by the norm kernel (GEMV_PUSH), give the same tokens
    as NCCL for everything (two ranks sum a + b either way). The peer run is a fresh
    process: only a process's first TP run uses peer memory (the peer_memory extension)."""
    nccl = _greedy(models["target"], tp_size=2, dtype="bfloat16", disable_custom_all_reduce=True)
    root = Path(__file__).resolve().parents[2]
    from minisgl import env as switches
    from minisgl.extensions.peer_memory import FUSED_ALL_REDUCE_NORM, GEMV_PUSH

    env = switches.child_environ(
        {FUSED_ALL_REDUCE_NORM: fused_norm == "1", GEMV_PUSH: gemv_push == "1"}
    )
    env["PYTHONPATH"] = f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    proc = subprocess.run(
        [sys.executable, "-c", _PEER_RUN, str(models["target"])],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["peer"], "the fresh process did not take the peer-memory path"
    assert (result["fused"] > 0) == (fused_norm == "1"), result["fused"]
    assert (result["pushes"] > 0) == (gemv_push == "1"), result["pushes"]
    assert result["clean"], "a slot of the fused all-reduce was left written (or never reset)"
    assert result["out"] == nccl
