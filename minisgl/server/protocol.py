"""Request bodies of the OpenAI-compatible API (pydantic), and the `SamplingParams` each asks
for (the native /generate's are in native_protocol.py).

Shape errors are pydantic's job (reported as 400); value ranges are checked once, when the
SamplingParams is built, so the server and the offline API agree on what is valid.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, cast

from pydantic import BaseModel, Field, StrictInt

from minisgl.ipc.messages import JSONDict, SubmitItem
from minisgl.sampling_params import GRAMMAR_FIELDS, SamplingParams
from minisgl.scheduler.policy import PRIORITY_MAX, PRIORITY_MIN
from minisgl.server.chat_hooks import ChatHook, ChatTools, Constraint, chat_hook
from minisgl.server.chat_messages import ChatMessage

MAX_N = 128  # choices per request: more is almost surely a mistake, and each one costs KV
# Seeds cross IPC as 64-bit integers; choice i of an n > 1 request uses seed + i, so leave room.
SEED_RANGE = (-(2**63), 2**63 - 1 - MAX_N)
# vLLM's / SGLang's request `priority` (used with --schedule-policy priority, lower first; the
# scheduler refuses a non-zero one without it). Strict: true or "1" is a 400 naming the field.
Priority = Annotated[StrictInt, Field(ge=PRIORITY_MIN, le=PRIORITY_MAX)] | None
MAX_TOKEN_ID = 2**31 - 1  # the scheduler reports ids outside the vocabulary precisely


def server_params(params: SamplingParams) -> SamplingParams:
    """The server's own limits, beyond what SamplingParams checks (ValueError naming n or
    seed)."""
    if params.n > MAX_N:
        raise ValueError(f"n must be at most {MAX_N}, got {params.n}")
    if params.seed is not None and not SEED_RANGE[0] <= params.seed <= SEED_RANGE[1]:
        raise ValueError(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {params.seed}")
    return params


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: running usage in every chunk


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
    response_format: JSONDict | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None
    # OpenAI fields this server does not implement, accepted in their neutral form only: a
    # client that relies on one gets a 400 naming it, not output that silently ignored it.
    logit_bias: dict[str, float] | None = None

    def _refuse_unsupported(self) -> None:
        if self.logit_bias:
            raise ValueError("logit_bias must be empty: this server does not support logit bias")

    def _constraint(self) -> Constraint:
        given = Constraint(json_schema=self.json_schema, regex=self.regex, ebnf=self.ebnf)
        schema = response_format_schema(self.response_format)
        if schema is None:
            return given
        if given.has_grammar:
            raise ValueError(
                "response_format must be 'text' when regex, ebnf or json_schema is set"
            )
        return Constraint(json_schema=schema)

    def _params(
        self,
        max_tokens: int | None,
        constraint: Constraint,
        top_logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams: ``top_logprobs`` None asks for no logprobs."""
        shared = self.model_dump(include=_SHARED_FIELDS, exclude_none=True)
        return server_params(
            SamplingParams(
                **shared,
                max_tokens=max_tokens,
                logprobs=top_logprobs is not None,
                top_logprobs=top_logprobs or 0,
                prompt_logprobs=prompt_logprobs,
                **dataclasses.asdict(constraint),
            )
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every streamed chunk carries the usage so far (vLLM's continuous_usage_stats)."""
        opts = self.stream_options
        return bool(self.stream and opts and opts.continuous_usage_stats)


# The fields SamplingParams has too, by the same name and meaning (a field left out or null
# takes SamplingParams' default); the structured-output ones go through `Constraint`.
_PARAM_NAMES = {f.name for f in dataclasses.fields(SamplingParams)} - set(GRAMMAR_FIELDS)
_SHARED_FIELDS = _PARAM_NAMES & set(_OpenAISampling.model_fields)


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[JSONDict] | None = None  # OpenAI function tools (see chat_hooks.py)
    tool_choice: object = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool | None = None  # false: only the reply's first call is kept
    # vLLM / SGLang chat extensions, applied when the tokenizer worker renders the template.
    chat_template_kwargs: JSONDict | None = None  # e.g. {"enable_thinking": false}
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    # With a reasoning parser: thinking goes to reasoning_content (false: left in content).
    separate_reasoning: bool = True

    def chat_tools(self) -> ChatTools:
        return ChatTools(
            tools=self.tools or [],
            tool_choice=self.tool_choice,
            parallel_tool_calls=self.parallel_tool_calls is not False,
            # The reply may open with thinking unless ``enable_thinking`` is false.
            thinking=(self.chat_template_kwargs or {}).get("enable_thinking") is not False,
            separate_reasoning=self.separate_reasoning,
        )

    def submit_base(self) -> SubmitItem:
        """What every item of the request carries: the fields that shape how the
        conversation is rendered, and the priority."""
        return SubmitItem(
            0,
            chat_template_kwargs=self.chat_template_kwargs,
            continue_final_message=self.continue_final_message,
            add_generation_prompt=self.add_generation_prompt,
            tools=self.tools if self.chat_tools().uses_tools else None,
            priority=self.priority or 0,
        )

    def to_sampling_params(self, hook: ChatHook | None = None) -> SamplingParams:
        """``hook`` (the server's; default: the one of default settings) checks the tools and
        adds what they, or a reasoning parser, ask of the output (chat_hooks.py)."""
        hook = hook or chat_hook()
        self._refuse_unsupported()
        tools = self.chat_tools()
        hook.check(tools)
        constraint = hook.constrain(tools, self._constraint())
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        top_logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens, constraint, top_logprobs)

    def message_dicts(self) -> list[JSONDict]:
        return [m.as_dict() for m in self.messages]


class CompletionRequest(_OpenAISampling):
    # str | list[str] | list[int] | list[list[int]], checked in prompts(): pydantic's union
    # errors ("prompt.str: Input should be a valid string") would not tell the user much.
    prompt: object
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def to_sampling_params(self) -> SamplingParams:
        """With echo and logprobs the prompt is scored too (what evaluation harnesses use
        for log-likelihoods)."""
        self._refuse_unsupported()
        scored = (self.logprobs or 0) if self.echo and self.logprobs is not None else None
        return self._params(self.max_tokens, self._constraint(), self.logprobs, scored)

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


def _all_token_ids(items: list[object]) -> bool:
    """Every item an integer id in [0, MAX_TOKEN_ID] (bools are not ids). Checked with C-level
    passes (types, min, max), not a Python call per item: prompts run to thousands of ids,
    and a burst of them is parsed on the event loop that also streams every response."""
    if set(map(type, items)) != {int}:
        return False
    ids = cast("list[int]", items)
    return min(ids) >= 0 and max(ids) <= MAX_TOKEN_ID


def response_format_schema(response_format: JSONDict | None) -> str | None:
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
