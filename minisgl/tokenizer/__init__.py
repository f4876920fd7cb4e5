"""Tokenizer loading (Hugging Face directories and GGUF files) and detokenization helpers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from minisgl.models.resolve import ResolvedModel

# A Hugging Face tokenizer (PreTrainedTokenizerBase; its methods are typed too loosely to
# check calls against), or None where a model directory has none.
Tokenizer = Any


def load_tokenizer(resolved: ResolvedModel, override: str | None = None) -> Tokenizer:
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


# Arguments render_chat sets itself: a chat_template_kwargs entry may not override them.
_RESERVED_TEMPLATE_ARGS = frozenset(
    "conversation messages tokenize add_generation_prompt continue_final_message return_dict "
    "tools documents".split()
)


def render_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, object]],
    template_kwargs: Mapping[str, object] | None = None,
    continue_final_message: bool = False,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, object]] | None = None,
) -> list[int]:
    """Token ids of a conversation through the model's chat template. ``template_kwargs`` go to
    the template itself (e.g. Qwen3's ``enable_thinking``); ``continue_final_message`` leaves
    the last (assistant) message open for the model to continue, with no generation prompt."""
    kwargs = dict(template_kwargs or {})
    clash = sorted(_RESERVED_TEMPLATE_ARGS & kwargs.keys())
    if clash:
        raise ValueError(f"chat_template_kwargs must not set {', '.join(clash)}")
    if continue_final_message:
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError(
                "continue_final_message requires the last message to be the assistant's"
            )
        add_generation_prompt = False
    ids = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=True,
        tools=tools,
        **kwargs,
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]
