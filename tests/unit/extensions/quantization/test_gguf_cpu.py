"""GGUF weights kept quantized on CPU (extensions/quantization/gguf*.py, csrc/gguf_cpu.c).

References: gguf-py's own dequantizer for the block split (bit for bit), a float64 product
on the dequantized weights for each kernel, and the dequantized float32 path of the same
files (MINISGL_GGUF_KERNELS=0) for whole models, teacher-forced.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

import minisgl.extensions.quantization.gguf as gguf_method
import minisgl.llm
from minisgl import LLM, SamplingParams, env
from minisgl.extensions.quantization.gguf_blocks import SUPPORTED, split_blocks
from minisgl.extensions.quantization.gguf_kernels import Segment, kernels_available, pack
from minisgl.extensions.quantization.switches import GGUF_KERNELS
from minisgl.models.default_model import default_model_path
from tests.gguf_files import write_tiny_gguf

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K]
needs_kernels = pytest.mark.skipif(not kernels_available(), reason="AVX2 kernels not built")


def _blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid blocks of a [rows, cols] tensor with weights of about unit size: quantized by
    gguf where it can, else random bytes with sane float16 super-block scales."""
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    nbytes = 144 if qtype == Q.Q4_K else 210
    b = rng.integers(0, 256, size=(rows * cols // 256, nbytes), dtype=np.uint8)
    d = rng.uniform(0.005, 0.02, size=(b.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q4_K:
        b[:, 0:4] = d.reshape(-1, 4)  # d, dmin
    else:
        b[:, 208:210] = d[:, :2]
    return b.reshape(rows, -1)


def _split(qtype: Q, rows: int, cols: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    raw = _blocks(qtype, rows, cols, np.random.default_rng(seed))
    return raw, torch.from_numpy(np.asarray(dequantize(raw, qtype), dtype=np.float32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_split_is_gguf_dequantize_bit_for_bit(qtype: Q) -> None:
    raw, want = _split(qtype, 6, 512)
    s = split_blocks(raw, qtype, (6, 512))
    got = torch.from_numpy(s.codes).float().view(6, 32, 16) * torch.from_numpy(s.scale)[..., None]
    got = (got + torch.from_numpy(s.offset)[..., None]).view(6, 512)
    assert torch.equal(got, want)


def _quantized_acts(x: torch.Tensor) -> torch.Tensor:
    """The kernels' int16 activations, per 32 inputs, dequantized (float64)."""
    g = x.view(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 32767.0 / amax, torch.zeros_like(amax))
    q = torch.round(g * inv)  # round half to even, as nearbyintf
    return (q.double() * (amax / 32767.0).double()).view_as(x)


def _segment(qtype: Q, rows: int, cols: int, seed: int = 0) -> tuple[Segment, torch.Tensor]:
    raw, want = _split(qtype, rows, cols, seed)
    s = split_blocks(raw, qtype, (rows, cols))
    parts = [(0, qtype, *(torch.from_numpy(a) for a in (s.codes, s.scale, s.offset)))]
    (seg,) = pack(parts)  # type: ignore[arg-type]
    return seg, want


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 6])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_against_float64(qtype: Q, rows: int) -> None:
    seg, w = _segment(qtype, 40, 768)
    assert torch.equal(seg.dequantized(), w)  # packing rounds nothing
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
    out = torch.full((rows, 45), float("nan"))
    seg.start = 3  # columns 3..42 of a wider output, with a row stride of 45
    seg.matmul(x, out)
    xq = _quantized_acts(x)
    ref = xq @ w.double().T
    bound = (xq.abs() @ w.double().abs().T) * 2e-6 + 1e-6  # float32 accumulation
    assert ((out[:, 3:43].double() - ref).abs() <= bound).all()
    assert out[:, :3].isnan().all() and out[:, 43:].isnan().all()


@needs_kernels
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="no AVX-512")
@pytest.mark.parametrize("rows", [12, 16, 29, 40])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_float32_tiles_against_float64(qtype: Q, rows: int) -> None:
    # csrc/cpu_tile.c: float32 activations against float32 tiles of the dequantized weight;
    # 40 output rows leave a partial tile, 608 inputs a partial 128-input block, 40 rows two
    # passes (32 + 8).
    cols = 768 if qtype in (Q.Q4_K, Q.Q6_K) else 608
    seg, w = _segment(qtype, 40, cols)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    out = torch.full((rows, 45), float("nan"))
    dst = out.data_ptr() + 3 * out.element_size()
    seg.bound(40, 45, x.data_ptr(), rows, cols, dst, 1)  # tiles from 1 row on
    ref = x.double() @ w.double().T
    bound = (x.double().abs() @ w.double().abs().T) * 2e-6 + 1e-6  # float32 accumulation
    assert ((out[:, 3:43].double() - ref).abs() <= bound).all()
    assert out[:, :3].isnan().all() and out[:, 43:].isnan().all()


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantized_tiles_for_many_rows(qtype: Q, monkeypatch: pytest.MonkeyPatch) -> None:
    from minisgl.extensions.quantization import gguf_kernels

    monkeypatch.setattr(gguf_kernels, "DEQUANT_TILE_ROWS", 16)  # several tiles, a partial one
    seg, w = _segment(qtype, 40, 768)
    tile = torch.empty(40, 768)
    seg.bound_dequant(0, 40, 768, tile.data_ptr())
    # scale * code + offset as gguf-py computes it (Q4_0's offset form rounds differently).
    torch.testing.assert_close(tile, w, rtol=1e-6 if qtype == Q.Q4_0 else 0, atol=0)
    x = torch.randn(33, 768, generator=torch.Generator().manual_seed(0))
    out = torch.full((33, 45), float("nan"))
    seg.start = 2
    seg.matmul_dequantized(x, out)
    ref = x.double() @ w.double().T
    bound = (x.double().abs() @ w.double().abs().T) * 2e-5  # float32 GEMM over 768 inputs
    assert ((out[:, 2:42].double() - ref).abs() <= bound).all()
    assert out[:, :2].isnan().all() and out[:, 42:].isnan().all()


@needs_kernels
def test_mixed_runs_are_merged_by_layout() -> None:
    rng = np.random.default_rng(1)
    parts = []
    for start, qtype in ((0, Q.Q4_K), (8, Q.Q4_K), (16, Q.Q6_K), (24, Q.Q8_0)):
        s = split_blocks(_blocks(qtype, 8, 256, rng), qtype, (8, 256))
        parts.append((start, qtype, *(torch.from_numpy(a) for a in (s.codes, s.scale, s.offset))))
    segs = pack(parts)  # type: ignore[arg-type]
    assert [(s.start, s.rows, s.four_bit, s.group) for s in segs] == [
        (0, 16, True, 32),
        (16, 8, False, 16),
        (24, 8, False, 32),
    ]


# --------------------------------------------------------------------------------------------
# Whole models: the kernels against the dequantized float32 path of the same file
# --------------------------------------------------------------------------------------------


@pytest.fixture
def no_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(minisgl.llm, "load_tokenizer", lambda *a, **k: None)


def _teacher_forced(path: Path, tokens: list[int], kernels: bool) -> torch.Tensor:
    """Log-softmax over the vocabulary at every position of ``tokens`` (float32). The prompt
    runs through the integer kernels, as decode steps do (prefills of 32+ rows would take
    the dequantized tiles, which would make the comparison close to trivial)."""
    seen: list[torch.Tensor] = []
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    with env.override({GGUF_KERNELS: kernels}), pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_method, "DEQUANT_MIN_ROWS", 1 << 30)
        llm = LLM(str(path), chunked_prefill_size=4096, max_running_requests=1)
        hook = lambda _m, _i, out: seen.append(out.float().clone())  # noqa: E731
        llm.engine.model.register_forward_hook(hook)
        llm.generate([tokens], params, use_tqdm=False)
    llm.close()
    # The prefill's rows: the sampling row (last position), then positions 0 .. n-2.
    logits = torch.cat([seen[0][1:], seen[0][:1]])
    return torch.log_softmax(logits, dim=-1)


def _agreement(path: Path, tokens: list[int]) -> tuple[float, float]:
    """(top-1 agreement, mean |chosen-token logprob difference|) over the positions."""
    quant, ref = (_teacher_forced(path, tokens, k) for k in (True, False))
    top1 = (quant.argmax(-1) == ref.argmax(-1)).float().mean().item()
    nxt = torch.tensor(tokens[1:])[:, None]
    diff = (quant[:-1].gather(1, nxt) - ref[:-1].gather(1, nxt)).abs().mean().item()
    return top1, diff


@needs_kernels
@pytest.mark.usefixtures("no_tokenizer")
@pytest.mark.parametrize(
    "types",
    [
        {"": Q.Q4_0},
        {"": Q.Q4_1},
        {"": Q.Q8_0},
        {"": Q.Q4_K},
        {"": Q.Q6_K},
        {"": Q.Q4_K, "attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "token_embd": Q.Q8_0},  # Q4_K_M-like
    ],
    ids=["q4_0", "q4_1", "q8_0", "q4_k", "q6_k", "mixed"],
)
def test_tiny_models_agree_with_the_dequantized_path(tmp_path: Path, types: dict[str, Q]) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", types[""], vocab=512, tied=True, overrides=types)
    tokens = np.random.default_rng(0).integers(3, 512, size=400).tolist()
    top1, diff = _agreement(path, tokens)
    assert top1 >= 0.99 and diff <= 0.05, (top1, diff)


def _passage(tokens: int) -> Iterator[int]:
    from minisgl.models.gguf_loader import load_gguf_tokenizer

    text = (Path(__file__).parents[4] / "docs" / "architecture.md").read_text()
    ids = load_gguf_tokenizer(default_model_path()).encode(text)
    assert len(ids) >= tokens
    yield from ids[:tokens]


@needs_kernels
@pytest.mark.slow  # the tiny models above cover every type in the everyday suite
def test_default_model_agrees_over_1000_positions() -> None:
    top1, diff = _agreement(default_model_path(), list(_passage(1000)))
    assert top1 >= 0.99 and diff <= 0.05, (top1, diff)


def test_supported_types_are_the_five() -> None:
    assert set(SUPPORTED) == set(TYPES)


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


def test_unknown_block_type_names_the_tensor(tmp_path: Path) -> None:
    import gguf

    from minisgl.models.gguf_loader import gguf_hf_config

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", Q.Q8_0, layers=1)
    field = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_q.weight").field
    at = field.offset + sum(part.nbytes for part in field.parts[:4])  # the tensor's type id
    raw = bytearray(path.read_bytes())
    raw[at : at + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_q\.weight' has unknown block type id 99"):
        gguf_hf_config(path)


def test_undecodable_block_type_names_the_tensor(tmp_path: Path) -> None:
    import gguf

    from minisgl.layers.quantization import parse_quant_config
    from minisgl.models.gguf_loader import iter_gguf_weights

    path = tmp_path / "q8_1.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_head_count(1)
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 40 * 2), np.uint8), raw_dtype=Q.Q8_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="tensor_types: Q8_1 are not kept quantized"):
        parse_quant_config({"quant_method": "gguf", "tensor_types": ["Q4_K", "Q8_1"]})
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_q\.weight' has block type Q8_1"):
        list(iter_gguf_weights(path))


def test_cpu_threads_option() -> None:
    import os

    from minisgl.config import EngineConfig
    from minisgl.distributed.group import share_cpu_threads

    with pytest.raises(ValueError, match=r"cpu_threads=0 is invalid: >= 1"):
        EngineConfig.from_kwargs(cpu_threads=0)
    too_many = len(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match=rf"cpu_threads={too_many} is invalid: at most"):
        EngineConfig.from_kwargs(cpu_threads=too_many)
    before = torch.get_num_threads()
    try:
        share_cpu_threads(EngineConfig.from_kwargs(cpu_threads=1), torch.device("cpu"))
        assert torch.get_num_threads() == 1
        share_cpu_threads(EngineConfig.from_kwargs(cpu_threads=2, tp_size=2), torch.device("cpu"))
        assert torch.get_num_threads() == 1  # two TP ranks share the two threads
    finally:
        torch.set_num_threads(before)
