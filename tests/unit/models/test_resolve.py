"""resolve_model_path: local files/dirs, the default model, and an offline Hugging Face cache."""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub.constants as hf_constants
import pytest

from minisgl.models import resolve
from minisgl.models.resolve import ResolvedModel, resolve_model_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache in tmp_path, with the hub client forced offline."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads these variables once at import time, so patch its constants as well.
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    return cache


def _add_cached_repo(cache: Path, repo_id: str) -> Path:
    """Lay out a repo the way the hub client does: refs/main -> snapshots/<commit>/files."""
    repo_dir = cache / f"models--{repo_id.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(COMMIT)
    snapshot = repo_dir / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (snapshot / "tokenizer.json").write_text("{}")
    (snapshot / "model.safetensors").write_bytes(b"\0" * 8)
    return snapshot


def test_hf_repo_id_resolves_from_offline_cache(hf_cache: Path) -> None:
    snapshot = _add_cached_repo(hf_cache, "Org/Name")
    resolved = resolve_model_path("Org/Name")
    assert resolved == ResolvedModel(snapshot.resolve(), "hf_dir")
    assert (resolved.path / "config.json").is_file()


def test_uncached_repo_id_is_a_value_error(hf_cache: Path) -> None:
    _add_cached_repo(hf_cache, "Org/Name")
    with pytest.raises(ValueError, match=r"'Org/Missing' does not exist.*Hugging Face"):
        resolve_model_path("Org/Missing")


def test_nonexistent_path_names_the_path(tmp_path: Path, hf_cache: Path) -> None:
    missing = str(tmp_path / "no" / "such" / "model")
    with pytest.raises(ValueError, match="does not exist") as info:
        resolve_model_path(missing)
    assert missing in str(info.value)
    with pytest.raises(ValueError, match="'foo' does not exist"):
        resolve_model_path("foo")


def test_gguf_file(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert resolve_model_path(str(gguf)) == ResolvedModel(gguf.resolve(), "gguf")


def test_file_detected_by_magic_and_non_gguf_file_rejected(tmp_path: Path) -> None:
    odd_name = tmp_path / "weights.bin"
    odd_name.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert resolve_model_path(str(odd_name)).kind == "gguf"
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(ValueError, match="not a GGUF"):
        resolve_model_path(str(other))


def test_hf_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "stray.gguf").write_bytes(b"GGUF")  # config.json wins over GGUF files
    assert resolve_model_path(str(tmp_path)) == ResolvedModel(tmp_path.resolve(), "hf_dir")


def test_directory_with_single_gguf(tmp_path: Path) -> None:
    gguf = tmp_path / "only.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model_path(str(tmp_path)) == ResolvedModel(gguf.resolve(), "gguf")


def test_directory_with_several_ggufs_or_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither a config.json nor a .gguf"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="several GGUF files"):
        resolve_model_path(str(tmp_path))


def test_tilde_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    gguf = tmp_path / "home.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model_path("~/home.gguf") == ResolvedModel(gguf.resolve(), "gguf")


def test_none_means_default_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "default.gguf"
    monkeypatch.setattr(resolve, "default_model_path", lambda: fake)
    assert resolve_model_path(None) == ResolvedModel(fake, "gguf")
