"""The command line: one parser whose engine flags are generated from `EngineConfig`'s fields
(so a new config field is a new flag, with the same name everywhere), plus server flags."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from minisgl import env
from minisgl.config import EngineConfig

# Extra spellings users know from SGLang / mini-sglang / vLLM.
FLAG_ALIASES: dict[str, list[str]] = {
    "model": ["--model-path"],
    "tp_size": ["--tp", "--tensor-parallel-size"],
    "attention_backend": ["--attn"],
    "cache": ["--cache-type"],
    "context_length": ["--max-model-len"],
    "schedule_policy": ["--scheduling-policy"],  # vLLM's spelling
}

FLAG_HELP: dict[str, str] = {
    "model": "local directory, .gguf file, or Hugging Face id (default: bundled SmolLM2-135M)",
    "tokenizer": "tokenizer to use instead of the model's",
    "load_format": "auto | safetensors | gguf | dummy (random weights)",
    "dtype": "auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16",
    "device": "auto | cpu | cuda | cuda:N",
    "context_length": "cap on prompt + output tokens per request",
    "page_size": "tokens per KV page",
    "kv_cache_dtype": "KV cache element type: auto (the model's dtype) | fp8_e4m3 (alias fp8) "
    "| fp8_e5m2 (1 byte per element: about twice the tokens of a bf16 cache)",
    "num_pages": "KV pool size in pages (default: from the memory budget)",
    "mem_fraction_static": "GPU: share of device memory for weights + KV cache",
    "cpu_kv_cache_gb": "CPU: KV pool budget in GiB",
    "chunked_prefill_size": "token budget per scheduler step (default 8192 on CUDA, 256 on CPU)",
    "disable_mixed_batch": "never mix prefill chunks with decodes in one batch (prefill "
    "goes first: decodes wait while a prompt is prefilled)",
    "disable_fused_rope_store": "run q/k norm, RoPE and the KV-cache store as separate kernels "
    "(CUDA; outputs are identical either way)",
    "cache": "prefix cache: radix | naive",
    "schedule_policy": "fcfs | lpm (longest prefix match first) | priority (each request's "
    "priority field, lower values first; ties by arrival)",
    "attention_backend": "auto | torch | triton | flashinfer",
    "cuda_graph_max_bs": "largest CUDA-graph batch size (0 disables CUDA graphs)",
    "cuda_graph_max_tokens": "prefill/mixed steps up to this many tokens replay CUDA graphs "
    "(default 2048; 0 runs them eagerly)",
    "tp_size": "tensor-parallel degree",
    "disable_custom_all_reduce": "CUDA TP: all-reduce everything through NCCL (default: small "
    "tensors through GPU peer memory, which sums the same)",
    "max_running_requests": "most requests decoded at once",
    "seed": "engine seed (requests without a seed draw theirs from it)",
    "disable_overlap_scheduling": "run CPU scheduling and device compute one after the other",
    "init_new_token_ratio": "admission: expected share of max_tokens still to come, at first",
    "min_new_token_ratio": "admission: the floor that share decays to",
    "speculative_algorithm": "ngram | draft (default: draft when a draft model is given)",
    "speculative_num_steps": "draft tokens proposed per request per step",
    "speculative_draft_model": "draft model (same vocabulary) for --speculative-algorithm draft",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(annotation: Any) -> type:
    """int for `int | None`, etc."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return args[0]  # type: ignore[no-any-return]
    return annotation  # type: ignore[no-any-return]


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (EngineConfig)")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        kind = _base_type(hints[f.name])
        names = [_flag(f.name), *FLAG_ALIASES.get(f.name, [])]
        help_text = FLAG_HELP.get(f.name, "")
        if kind is bool:
            # A False default is a plain switch; a True default also gets --no-<flag>.
            action: Any = argparse.BooleanOptionalAction if f.default else "store_true"
            group.add_argument(
                *names, dest=f.name, action=action, default=f.default, help=help_text or None
            )
        else:
            if "default" not in help_text:
                help_text = f"{help_text} (default: {f.default})".strip()
            group.add_argument(
                *names, dest=f.name, type=kind, default=f.default, metavar=kind.__name__.upper(),
                help=help_text,
            )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minisgl",
        description="minisgl: serve an LLM over an OpenAI-compatible API, or chat in a shell.",
        allow_abbrev=False,  # a prefix of one flag must not silently become another flag
    )
    add_engine_flags(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=1919, help="port to listen on")
    server.add_argument("--served-model-name", default=None, help="model name in API responses")
    server.add_argument(
        "--reasoning-parser", default=None, choices=["qwen3", "deepseek-r1"],
        help="chat replies: put the model's thinking (<think>...</think>) in reasoning_content",
    )  # fmt: skip
    server.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"],
        help="logging verbosity",
    )  # fmt: skip
    add_reliability_flags(parser)
    shell = parser.add_argument_group("shell")
    shell.add_argument("--shell", action="store_true", help="interactive chat shell, no server")
    shell.add_argument("--temperature", type=float, default=0.6, help="shell: sampling temperature")
    shell.add_argument("--top-p", type=float, default=0.95, help="shell: nucleus sampling")
    shell.add_argument("--max-tokens", type=int, default=512, help="shell: longest answer")
    return parser


def _number(kind: type, minimum: float, name: str) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error messages
    return parse


def add_reliability_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server protection")
    group.add_argument(
        "--api-key", default=None, metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health and "
        f"/health_generate (default: ${env.API_KEY.env_name} if set, else no authentication)",
    )  # fmt: skip
    group.add_argument(
        "--max-queued-requests", type=_number(int, 0, "--max-queued-requests"), default=None,
        metavar="N", help="answer 503 (Retry-After) instead of queueing more than N waiting "
        "requests (default: unlimited)",
    )  # fmt: skip
    group.add_argument(
        "--request-timeout", type=_number(float, 0.001, "--request-timeout"), default=None,
        metavar="S", help="abort requests still unfinished S seconds after arrival, freeing "
        "their KV (HTTP 504 / an error event) (default: none)",
    )  # fmt: skip
    group.add_argument(
        "--health-timeout", type=_number(float, 0.1, "--health-timeout"), default=60.0,
        metavar="S", help="/health answers 503 once the scheduler has left a liveness ping "
        "unanswered for S seconds (it looks hung; one step may legitimately take long, e.g. "
        "a huge prefill); /health_generate waits at most S for output (default: 60)",
    )  # fmt: skip
    group.add_argument(
        "--max-request-bytes", type=_number(int, 1, "--max-request-bytes"), default=8 << 20,
        metavar="N", help="larger request bodies get 413 (default: 8 MiB)",
    )  # fmt: skip
    group.add_argument(
        "--shutdown-timeout", type=_number(float, 0, "--shutdown-timeout"), default=30.0,
        metavar="S", help="on SIGTERM, how long running requests may take to finish before "
        "they are aborted (default: 30)",
    )  # fmt: skip


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_kwargs(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = engine_config(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.shell:
        from minisgl.sampling_params import SamplingParams
        from minisgl.shell import run_shell

        try:
            params = SamplingParams(
                temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens
            )
        except ValueError as exc:
            parser.error(str(exc))
        return run_shell(config, params)
    from minisgl.server.launch import ServerArgs, serve

    return serve(
        config,
        ServerArgs(
            host=args.host, port=args.port,
            served_model_name=args.served_model_name, log_level=args.log_level,
            # An empty key (e.g. MINISGL_API_KEY= in a unit file) means "no key", not "".
            api_key=args.api_key or env.API_KEY.get() or None,
            max_queued_requests=args.max_queued_requests,
            request_timeout=args.request_timeout,
            health_timeout=args.health_timeout,
            max_request_bytes=args.max_request_bytes,
            shutdown_timeout=args.shutdown_timeout,
            reasoning_parser=args.reasoning_parser,
        ),
    )  # fmt: skip
