"""Turn a user's ``--model`` argument into a concrete local checkpoint.

Accepted forms, in order: nothing (the bundled default GGUF), a ``.gguf`` file, a Hugging Face
checkpoint directory (or a directory holding a single ``.gguf``), or a Hugging Face repo id that
is already in (or can be fetched into) the local hub cache.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from minisgl.models.default_model import default_model_path

ModelKind = Literal["hf_dir", "gguf"]

# Only what loading needs: configs, tokenizer files, safetensors weights, chat templates.
# Notably not *.bin / *.pt / *.gguf, which would multiply the download for nothing.
HF_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
_GGUF_MAGIC = b"GGUF"
# "org/name": one slash, hub-legal characters, not a relative path such as ./x or ../x.
_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


@dataclass(frozen=True)
class ResolvedModel:
    path: Path
    kind: ModelKind


def resolve_model_path(model: str | None) -> ResolvedModel:
    """Resolve ``model`` (None, a path, or a Hugging Face repo id) to a local checkpoint."""
    if model is None:
        return ResolvedModel(default_model_path(), "gguf")
    path = Path(model).expanduser()
    if path.exists():
        return _resolve_local(path, model)
    if not _REPO_ID_RE.match(model):
        raise ValueError(
            f"model path {model!r} does not exist and does not look like a Hugging Face "
            "model id (org/name)"
        )
    try:
        snapshot = _snapshot_download(model)
    except Exception as exc:  # hub errors are many and varied; all mean "not available"
        raise ValueError(
            f"model path {model!r} does not exist and is not a Hugging Face model id that "
            f"could be found: {exc}"
        ) from exc
    return _resolve_local(Path(snapshot), model)


def _snapshot_download(repo_id: str) -> str:
    # Imported lazily: the hub client is only needed for repo ids. snapshot_download honours
    # HF_HUB_OFFLINE / HF_HUB_CACHE and serves from the local cache when the hub is unreachable.
    from huggingface_hub import snapshot_download

    return str(snapshot_download(repo_id, allow_patterns=HF_ALLOW_PATTERNS))


def _resolve_local(path: Path, original: str) -> ResolvedModel:
    if path.is_file():
        if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
            return ResolvedModel(path.resolve(), "gguf")
        raise ValueError(f"model path {original!r} is a file but not a GGUF file")
    if (path / "config.json").is_file():
        return ResolvedModel(path.resolve(), "hf_dir")
    ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(ggufs) == 1:
        return ResolvedModel(ggufs[0].resolve(), "gguf")
    if ggufs:
        names = ", ".join(p.name for p in ggufs)
        raise ValueError(
            f"model directory {original!r} holds several GGUF files ({names}); pass one of them"
        )
    raise ValueError(f"model directory {original!r} has neither a config.json nor a .gguf file")


def _has_gguf_magic(path: Path) -> bool:
    try:
        with path.open("rb") as fh:
            return fh.read(4) == _GGUF_MAGIC
    except OSError:
        return False
