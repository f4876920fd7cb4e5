"""Request bodies of the HTTP API (pydantic), and their translation to `SamplingParams`.

Shape errors are pydantic's job (reported as 400); value ranges are checked once, by
`SamplingParams.validate`, so the server and the offline API agree on what is valid.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from minisgl.sampling_params import GRAMMAR_FIELDS, SamplingParams
from minisgl.scheduler.policy import PRIORITY_MAX, PRIORITY_MIN
from minisgl.server.reasoning import END as THINK_END
from minisgl.server.tool_calls import call_grammar, check_tools

MAX_N = 128  # choices per request: more is almost surely a mistake, and each one costs KV
# Seeds cross IPC as 64-bit integers; choice i of an n > 1 request uses seed + i, so leave room.
SEED_RANGE = (-(2**63), 2**63 - 1 - MAX_N)
# vLLM's / SGLang's request `priority` (used with --schedule-policy priority, lower first; the
# scheduler refuses a non-zero one without it). Strict: true or "1" is a 400 naming the field.
Priority = Annotated[StrictInt, Field(ge=PRIORITY_MIN, le=PRIORITY_MAX)] | None


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: running usage in every chunk


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def as_dict(self) -> dict[str, Any]:
        """The message as chat templates take it: text content; earlier calls with their
        arguments as objects (templates serialise them; OpenAI sends JSON strings)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _OpenAISampling(BaseModel):
    """Fields shared by chat and text completions (OpenAI, plus SGLang's extras)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # SGLang / vLLM extensions
    priority: Priority = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None  # SGLang: stop at a regular expression's match
    skip_special_tokens: bool = True
    # Structured output: OpenAI's response_format, or SGLang's fields (at most one).
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None
    # OpenAI fields this server does not implement, accepted in their neutral form only: a
    # client that relies on one gets a 400 naming it, not output that silently ignored it.
    logit_bias: dict[str, float] | None = None

    def _refuse_unsupported(self) -> None:
        if self.logit_bias:
            raise ValueError("logit_bias must be empty: this server does not support logit bias")

    def _grammar_fields(self) -> dict[str, Any]:
        fields = {"regex": self.regex, "ebnf": self.ebnf, "json_schema": self.json_schema}
        schema = response_format_schema(self.response_format)
        if schema is not None:
            if any(v is not None for v in fields.values()):
                raise ValueError(
                    "response_format must be 'text' when regex, ebnf or json_schema is set"
                )
            fields["json_schema"] = schema
        return {k: v for k, v in fields.items() if v is not None}

    def _base_params(self, max_tokens: int | None) -> dict[str, Any]:
        self._refuse_unsupported()
        fields: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
            "max_tokens": max_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "stop_regex": self.stop_regex,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "n": self.n,
            **self._grammar_fields(),
        }
        return {k: v for k, v in fields.items() if v is not None or k == "max_tokens"}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every streamed chunk carries the usage so far (vLLM's continuous_usage_stats)."""
        opts = self.stream_options
        return bool(self.stream and opts and opts.continuous_usage_stats)


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None  # OpenAI function tools (server/tool_calls.py)
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool | None = None  # false: only the reply's first call is kept
    # vLLM / SGLang chat extensions, applied when the tokenizer worker renders the template.
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    # With --reasoning-parser: thinking goes to reasoning_content (false: left in content).
    separate_reasoning: bool = True

    @property
    def uses_tools(self) -> bool:
        """Tools go to the template and the reply is parsed for calls."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_fields(self) -> dict[str, Any]:
        """The SubmitItem fields that shape how the conversation is rendered."""
        return {
            "chat_template_kwargs": self.chat_template_kwargs,
            "continue_final_message": self.continue_final_message,
            "add_generation_prompt": self.add_generation_prompt,
            "tools": self.tools if self.uses_tools else None,
        }

    def _refuse_unsupported(self) -> None:
        super()._refuse_unsupported()
        check_tools(self.tools or [], self.tool_choice)

    def _grammar_fields(self) -> dict[str, Any]:
        fields = super()._grammar_fields()
        grammar = call_grammar(self.tools or [], self.tool_choice) if self.tools else None
        if grammar is not None:
            if fields:
                raise ValueError(
                    "tool_choice must be 'auto' or 'none' when the output format is constrained"
                )
            fields["ebnf"] = grammar
        return fields

    @property
    def thinking(self) -> bool:
        """Whether the reply may open with thinking: unless ``enable_thinking`` is false."""
        return (self.chat_template_kwargs or {}).get("enable_thinking") is not False

    def sampling_fields(self, reasoning_parser: str | None = None) -> dict[str, Any]:
        """With ``reasoning_parser`` (the server's --reasoning-parser) and thinking on, a
        grammar (response_format, regex, ebnf, a forced tool call) waits for the end of the
        thinking: the reasoning is free text, the content follows the grammar."""
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        fields = self._base_params(max_tokens)
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        fields["logprobs"] = self.logprobs
        fields["top_logprobs"] = self.top_logprobs or 0
        grammar = any(name in fields for name in GRAMMAR_FIELDS)
        if reasoning_parser is not None and self.thinking and grammar:
            fields["grammar_after"] = THINK_END
        return check_sampling_fields(fields)

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.as_dict() for m in self.messages]


class CompletionRequest(_OpenAISampling):
    # str | list[str] | list[int] | list[list[int]], checked in prompts(): pydantic's union
    # errors ("prompt.str: Input should be a valid string") would not tell the user much.
    prompt: Any
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def sampling_fields(self) -> dict[str, Any]:
        fields = self._base_params(self.max_tokens)
        if self.logprobs is not None:
            fields["logprobs"] = True
            fields["top_logprobs"] = self.logprobs
        return check_sampling_fields(fields)

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of texts or token-id lists (one per prompt)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p, list) and p:
            if _all_token_ids(p):
                return [list(p)]
            if all(isinstance(t, str) for t in p):
                return list(p)
            if all(isinstance(t, list) and t and _all_token_ids(t) for t in p):
                return [list(t) for t in p]
        if p == [] or p == [[]]:
            raise ValueError("prompt is empty: at least one token is required")
        raise ValueError(
            "prompt must be a string, a list of strings, a list of token ids "
            f"(integers in [0, {MAX_TOKEN_ID}]), or a list of token-id lists"
        )


MAX_TOKEN_ID = 2**31 - 1  # the scheduler reports ids outside the vocabulary precisely


def _all_token_ids(items: list[Any]) -> bool:
    """Every item an integer id in [0, MAX_TOKEN_ID] (bools are not ids). Checked with C-level
    passes (types, min, max), not a Python call per item: prompts run to thousands of ids,
    and a burst of them is parsed on the event loop that also streams every response."""
    return set(map(type, items)) == {int} and min(items) >= 0 and max(items) <= MAX_TOKEN_ID


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
        return [list(ids)], False  # type: ignore[arg-type]

    def sampling_fields(self) -> dict[str, Any]:
        sp = self.sampling_params
        fields = {
            "max_tokens": sp.max_new_tokens,
            "min_tokens": sp.min_new_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k,
            "min_p": sp.min_p,
            "frequency_penalty": sp.frequency_penalty,
            "presence_penalty": sp.presence_penalty,
            "repetition_penalty": sp.repetition_penalty,
            "stop": sp.stop,
            "stop_token_ids": sp.stop_token_ids,
            "stop_regex": sp.stop_regex,
            "ignore_eos": sp.ignore_eos,
            "skip_special_tokens": sp.skip_special_tokens,
            "n": sp.n,
            "seed": sp.seed,
            "json_schema": sp.json_schema,
            "regex": sp.regex,
            "ebnf": sp.ebnf,
            "logprobs": self.return_logprob,
            "top_logprobs": self.top_logprobs_num if self.return_logprob else 0,
        }
        return check_sampling_fields(fields)


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise ValueError("tool_calls must be objects with a 'function' object")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise ValueError("tool_calls must carry function.arguments as JSON") from None
    return {**call, "function": {**fn, "arguments": args}}


def response_format_schema(response_format: dict[str, Any] | None) -> str | None:
    """OpenAI's ``response_format`` as the JSON schema (text) the output must match, or None
    for free text. ``json_object`` is any JSON object."""
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return '{"type": "object"}'
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema", spec.get("schema_")) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError(
                "response_format must carry json_schema.schema (a JSON Schema object) for type "
                "'json_schema'"
            )
        return json.dumps(schema)
    raise ValueError(
        f"response_format must be of type 'text', 'json_object' or 'json_schema', not {kind!r}"
    )


def check_sampling_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """Validate through SamplingParams (ValueError names the field); return the full field
    dict to send, with max_tokens None kept as "fill the context"."""
    probe = dict(fields)
    if probe.get("max_tokens") is None:
        probe["max_tokens"] = max(1, int(probe.get("min_tokens") or 0))
    params = SamplingParams(**probe)
    if params.n > MAX_N:
        raise ValueError(f"n must be at most {MAX_N}, got {params.n}")
    if params.seed is not None and not SEED_RANGE[0] <= params.seed <= SEED_RANGE[1]:
        raise ValueError(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {params.seed}")
    # A shallow copy (asdict deep-copies, field by field, on every request).
    out = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    out["max_tokens"] = fields.get("max_tokens")
    return out


_FIELD_RE = re.compile(r"^(\w+) (must|requires)")


def param_of(message: str) -> str | None:
    """The field a validation message names (messages start with the field name)."""
    m = _FIELD_RE.match(message)
    return m.group(1) if m else None


def choice_params(fields: dict[str, Any], index: int) -> dict[str, Any]:
    """The fields for choice ``index`` of an n > 1 request: each choice is its own sequence,
    with a distinct seed so that seeded choices still differ (and stay reproducible)."""
    out = dict(fields, n=1)
    if out.get("seed") is not None:
        out["seed"] = out["seed"] + index
    return out
