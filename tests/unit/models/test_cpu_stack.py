"""The one-call CPU decode stack (models/cpu_stack.py, csrc/cpu_stack.c) against the layers
run one by one (MINISGL_CPU_STACK=0) on the same GGUF files: decode steps of several rows,
layers that mix block types, and the cases that must fall back to the layers."""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import minisgl.llm
from minisgl import LLM, SamplingParams, env
from minisgl.env import CPU_STACK
from minisgl.extensions.quantization.gguf_kernels import kernels_available
from minisgl.models.cpu_stack import CpuDecodeStack
from tests.gguf_files import write_tiny_gguf

pytestmark = pytest.mark.skipif(not kernels_available(), reason="AVX2 kernels not built")

MIXED = {"": Q.Q4_K, "attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "token_embd": Q.Q8_0}  # Q4_K_M-like


@pytest.fixture
def stack_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of every decode step the C stack ran."""
    monkeypatch.setattr(minisgl.llm, "load_tokenizer", lambda *a, **k: None)
    calls: list[int] = []
    run = CpuDecodeStack.run

    def counted(self: CpuDecodeStack, layers: list, x: object, batch: object) -> object:
        out = run(self, layers, x, batch)  # type: ignore[arg-type]
        if out is not None:
            calls.append(out[0].shape[0])
        return out

    monkeypatch.setattr(CpuDecodeStack, "run", counted)
    return calls


_libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
_libm.expf.restype, _libm.expf.argtypes = ctypes.c_float, [ctypes.c_float]


def _c_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up rounded as csrc/cpu_stack.c rounds it (libm's expf, float32 steps)."""
    gate, up = (t.contiguous().numpy() for t in x.chunk(2, dim=-1))
    e = np.array([_libm.expf(float(-v)) for v in gate.ravel()], dtype=np.float32)
    silu = gate / (np.float32(1) + e.reshape(gate.shape))
    return torch.from_numpy((silu * up).astype(np.float32))


def _generate(
    path: Path, on: bool, prompts: list[list[int]], c_silu: bool = False
) -> list[dict[str, Any]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=True)
    with env.override({CPU_STACK: on}):
        llm = LLM(str(path))
        if c_silu:
            for layer in llm.engine.model.model.layers:
                layer.mlp.act = _c_silu_and_mul
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.close()
    return outs  # type: ignore[return-value]


def _prompts(n: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(3, vocab, size=5 + 7 * i).tolist() for i in range(n)]


@pytest.mark.parametrize("types", [{"": Q.Q4_1}, MIXED], ids=["q4_1", "mixed"])
def test_stack_decodes_as_the_layers_do(
    tmp_path: Path, types: dict[str, Q], stack_calls: list[int]
) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", types[""], vocab=512, tied=True, overrides=types, layers=3)
    prompts = _prompts(5, 512)  # rows of different lengths decoding together
    on = _generate(path, True, prompts)
    assert stack_calls and max(stack_calls) == 5, stack_calls
    # The same kernels in the same order: with every SiLU of the run (the prefill's too)
    # rounded as C rounds it, the same floats; with torch's SiLU in the layers (1 ulp apart
    # at some inputs), the same tokens.
    exact_on = _generate(path, True, prompts, c_silu=True)
    stack_calls.clear()
    exact_off = _generate(path, False, prompts, c_silu=True)
    off = _generate(path, False, prompts)
    assert not stack_calls
    for a, b, c, d in zip(exact_on, exact_off, on, off, strict=True):
        assert a["token_ids"] == b["token_ids"] == c["token_ids"] == d["token_ids"]
        assert a["logprobs"] == b["logprobs"]
        assert np.abs(np.subtract(c["logprobs"], d["logprobs"])).max() < 2e-3


def test_rows_beyond_the_kernels_limit_run_the_layers(
    tmp_path: Path, stack_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    import minisgl.extensions.quantization.gguf as gguf_method

    monkeypatch.setattr(gguf_method, "DEQUANT_MIN_ROWS", 3)  # the kernels take up to 2 rows
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", Q.Q8_0, vocab=512, tied=True)
    prompts = _prompts(4, 512)
    on = _generate(path, True, prompts)
    assert not stack_calls  # every decode step had 4 rows: layer by layer
    off = _generate(path, False, prompts)
    assert [o["token_ids"] for o in on] == [o["token_ids"] for o in off]
    _generate(path, True, prompts[:2])
    assert stack_calls and max(stack_calls) == 2


def test_float_and_qk_norm_models_run_the_layers(tmp_path: Path, stack_calls: list[int]) -> None:
    for arch, qtype in (("llama", Q.F32), ("qwen3", Q.Q8_0)):
        path = tmp_path / f"{arch}.gguf"
        write_tiny_gguf(path, arch, qtype, vocab=512)
        _generate(path, True, _prompts(2, 512))
    assert not stack_calls
