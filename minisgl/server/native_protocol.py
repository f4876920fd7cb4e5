"""Request body of SGLang's native /generate (pydantic), and the `SamplingParams` it asks
for."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from minisgl.sampling_params import SamplingParams
from minisgl.server.protocol import Priority, server_params


class GenerateSamplingParams(BaseModel):
    """SGLang's `sampling_params` object; unknown keys are rejected rather than ignored, so a
    misspelt or unsupported option (e.g. `max_tokens`) is an error, not a surprise."""

    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    seed: int | None = Field(default=None, alias="sampling_seed")
    # Structured output (at most one): a JSON schema (as a JSON string), a regular
    # expression, or an EBNF grammar.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class GenerateRequest(BaseModel):
    """SGLang's native /generate: one prompt (text or token ids) or a batch of them."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    rid: str | None = None
    priority: Priority = None

    def prompts(self) -> tuple[list[str | list[int]], bool]:
        """(prompts, is_batch)."""
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of text and input_ids must be given")
        if self.text is not None:
            if isinstance(self.text, str):
                return [self.text], False
            if not self.text:
                raise ValueError("text is an empty list: at least one prompt is required")
            return list(self.text), True
        ids = self.input_ids or []
        if ids and isinstance(ids[0], list):
            return list(ids), True  # type: ignore[arg-type]
        return [list(ids)], False  # type: ignore[list-item]

    def to_sampling_params(self) -> SamplingParams:
        sp = self.sampling_params
        # Every other field is a SamplingParams field by the same name.
        shared = sp.model_dump(exclude={"max_new_tokens", "min_new_tokens"})
        return server_params(
            SamplingParams(
                **shared,
                max_tokens=sp.max_new_tokens,
                min_tokens=sp.min_new_tokens,
                logprobs=self.return_logprob,
                top_logprobs=self.top_logprobs_num if self.return_logprob else 0,
            )
        )
