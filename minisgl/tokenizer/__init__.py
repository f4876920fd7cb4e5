"""Tokenizer loading (Hugging Face directories and GGUF files) and detokenization helpers."""

from __future__ import annotations

from typing import Any

from minisgl.models.resolve import ResolvedModel


def load_tokenizer(resolved: ResolvedModel, override: str | None = None) -> Any:
    from transformers import AutoTokenizer

    if override:
        return AutoTokenizer.from_pretrained(override)
    if resolved.kind == "gguf":
        from minisgl.models.gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(resolved.path)
    path = resolved.path
    has_files = any(
        (path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    )
    if not has_files:
        # A config-only directory (dummy-weight benchmarks): token-id prompts only.
        return None
    return AutoTokenizer.from_pretrained(str(path))


def trim_stop(text: str, stop: str | list[str] | tuple[str, ...] | None) -> str:
    """Cut the text at the first stop string: stop strings never appear in the output."""
    if not stop:
        return text
    stops = [stop] if isinstance(stop, str) else list(stop)
    cut = min((i for s in stops if (i := text.find(s)) >= 0), default=-1)
    return text if cut < 0 else text[:cut]
