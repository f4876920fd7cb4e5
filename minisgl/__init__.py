"""minisgl: a compact, fast LLM serving engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from minisgl.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from minisgl.llm import LLM


def __getattr__(name: str) -> Any:
    # Import the engine lazily: `import minisgl` stays cheap for the server and the CLI.
    if name == "LLM":
        from minisgl.llm import LLM

        return LLM
    raise AttributeError(name)
