"""Engine options: one frozen `EngineConfig`. The command line's engine flags and the
``LLM(**options)`` keywords are generated from its fields, so an option has one name
everywhere; each field's metadata holds its help text and any extra spellings.

Extensions add options of their own without this module knowing them: an extension
registers an `OptionGroup` (a frozen dataclass of its fields, and a check of the whole
configuration), and its values travel inside `EngineConfig.extensions`, read with
``config.ext(TheirOptions)``. Flags and keywords of registered groups are flat (e.g.
``--speculative-algorithm``), like the core's.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

C = TypeVar("C")

# --kv-cache-dtype values (minisgl/kvcache/kv_dtype.py maps them to torch dtypes); "fp8" is
# vLLM's spelling of fp8_e4m3.
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "fp8")


def option(default: Any, help: str, *aliases: str) -> Any:
    """A configuration field: its default, its --help text and extra flag spellings."""
    return field(default=default, metadata={"help": help, "aliases": aliases})


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = option(
        None,
        "local directory, .gguf file, or Hugging Face id (default: bundled SmolLM2-135M)",
        "--model-path",
    )
    tokenizer: str | None = option(None, "tokenizer to use instead of the model's")
    load_format: str = option("auto", "auto | safetensors | gguf | dummy (random weights)")
    dtype: str = option("auto", "auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16")
    device: str = option("auto", "auto | cpu | cuda | cuda:N")
    seed: int = option(0, "engine seed (requests without a seed draw theirs from it)")
    context_length: int | None = option(
        None, "cap on prompt + output tokens per request", "--max-model-len"
    )
    page_size: int = option(1, "tokens per KV page")
    # fp8 holds twice a bf16 pool's tokens in the same memory (scale 1.0, saturating stores).
    kv_cache_dtype: str = option(
        "auto",
        "KV cache element type: auto (the model's dtype) | fp8_e4m3 (alias fp8) | fp8_e5m2 "
        "(1 byte per element: about twice the tokens of a bf16 cache)",
    )
    num_pages: int | None = option(None, "KV pool size in pages (default: from the memory budget)")
    mem_fraction_static: float = option(0.85, "GPU: share of device memory for weights + KV cache")
    cpu_kv_cache_gb: float = option(1.0, "CPU: KV pool budget in GiB")
    # None: 1024 on CUDA (a wave of admissions rarely waits for a slot: measured on the H200
    # shared-prefix benchmark, benchmark/RESULTS.md), 256 on CPU.
    max_running_requests: int | None = option(None, "most requests decoded at once")
    # None: 8192 on CUDA; 256 on CPU, where a big prefill step stalls every running stream
    # for its whole length (p99 ITL about halved at equal throughput, RESULTS.md).
    chunked_prefill_size: int | None = option(
        None, "token budget per scheduler step (default 8192 on CUDA, 256 on CPU)"
    )
    # Prefill goes first: running decodes wait while any prompt has tokens left to prefill
    # (tests/unit/scheduler/test_policies.py).
    disable_mixed_batch: bool = option(
        False,
        "never mix prefill chunks with decodes in one batch (prefill goes first: decodes wait "
        "while a prompt is prefilled)",
    )
    cache: str = option("radix", "prefix cache: radix | naive", "--cache-type")
    schedule_policy: str = option(
        "fcfs",
        "fcfs | lpm (longest prefix match first) | priority (each request's priority field, "
        "lower values first; ties by arrival)",
        "--scheduling-policy",
    )
    attention_backend: str = option("auto", "auto | torch | triton | flashinfer", "--attn")
    cuda_graph_max_bs: int | None = option(
        None, "largest CUDA-graph batch size (0 disables CUDA graphs)"
    )
    cuda_graph_max_tokens: int | None = option(
        None,
        "prefill/mixed steps up to this many tokens replay CUDA graphs (default 2048; 0 runs "
        "them eagerly)",
    )
    disable_overlap_scheduling: bool = option(
        False, "run CPU scheduling and device compute one after the other"
    )
    disable_fused_rope_store: bool = option(
        False,
        "run q/k norm, RoPE and the KV-cache store as separate kernels (CUDA; outputs are "
        "identical either way)",
    )
    tp_size: int = option(1, "tensor-parallel degree", "--tp", "--tensor-parallel-size")
    # Multi-node TP (SGLang's names): tp_size // nnodes ranks per node; node 0 holds rank 0
    # and is the only one that serves HTTP.
    nnodes: int = option(1, "nodes of a multi-node TP run")
    node_rank: int = option(0, "this node's index in a multi-node TP run")
    dist_init_addr: str | None = option(
        None, "rank 0's host:port for the rendezvous (default on one node: a free local port)"
    )
    speculative_algorithm: str | None = option(
        None, "ngram | draft (default: draft when a draft model is given)"
    )
    speculative_num_steps: int = option(4, "draft tokens proposed per request per step")
    speculative_draft_model: str | None = option(
        None, "draft model (same vocabulary) for --speculative-algorithm draft"
    )
    init_new_token_ratio: float = option(
        0.7, "admission: expected share of max_tokens still to come, at first"
    )
    min_new_token_ratio: float = option(0.1, "admission: the floor that share decays to")
    # The option groups of extensions, one instance each (see OptionGroup).
    extensions: tuple[object, ...] = field(default=(), metadata={"internal": True})

    def __post_init__(self) -> None:
        if self.speculative_draft_model is not None and self.speculative_algorithm is None:
            object.__setattr__(self, "speculative_algorithm", "draft")
        for name, ok, want in _CHECKS:
            if not ok(self):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: {want(self)}")

    def ext(self, kind: type[C]) -> C:
        """The options of one extension's group (its defaults if it was not given)."""
        for group in self.extensions:
            if isinstance(group, kind):
                return group
        return kind()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """The configuration from flat keywords: the core's fields and every registered
        extension group's; ValueError naming any keyword nobody takes."""
        groups = [g for g in option_groups() if not g.server]
        taken = set(option_names(cls))
        for g in groups:
            taken |= set(option_names(g.options))
        unknown = set(kwargs) - taken
        if unknown:
            raise ValueError(f"unknown option(s): {', '.join(sorted(unknown))}{_loaded_note()}")
        exts = tuple(_build(g.options, kwargs) for g in groups)
        config = cls(**_pick(cls, kwargs), extensions=exts)
        for g in groups:
            g.check(config)
        return config


def _in(*values: object) -> Callable[[Any], str]:
    return lambda c: ", ".join(map(str, values))


def _want(text: str) -> Callable[[Any], str]:
    return lambda c: text.format(c=c)


def _at_least(value: float | None, low: float) -> bool:
    """None (auto) or at least ``low``."""
    return value is None or value >= low


def _host_port_ok(addr: str) -> bool:
    host, sep, port = addr.rpartition(":")
    return bool(sep and host.strip("[]") and port.isdigit() and 1 <= int(port) <= 65535)


# (field, test, what a valid value is): EngineConfig's checks, in the order they apply.
_CHECKS: list[tuple[str, Callable[[EngineConfig], bool], Callable[[EngineConfig], str]]] = [
    ("page_size", lambda c: c.page_size >= 1, _want("must be >= 1")),
    ("num_pages", lambda c: _at_least(c.num_pages, 2), _want(">= 2")),
    ("max_running_requests", lambda c: _at_least(c.max_running_requests, 1), _want(">= 1")),
    ("cuda_graph_max_tokens", lambda c: _at_least(c.cuda_graph_max_tokens, 0), _want(">= 0")),
    ("chunked_prefill_size", lambda c: _at_least(c.chunked_prefill_size, 1), _want(">= 1")),
    ("cache", lambda c: c.cache in ("radix", "naive"), _want("radix or naive")),
    (
        "schedule_policy",
        lambda c: c.schedule_policy in ("fcfs", "lpm", "priority"),
        _want("fcfs, lpm or priority"),
    ),
    (
        "load_format",
        lambda c: c.load_format in ("auto", "safetensors", "gguf", "dummy"),
        _want("auto, safetensors, gguf or dummy"),
    ),
    (
        "dtype",
        lambda c: c.dtype in ("auto", "float32", "bfloat16", "float16"),
        _want("auto, float32, bfloat16 or float16"),
    ),
    ("kv_cache_dtype", lambda c: c.kv_cache_dtype in KV_CACHE_DTYPES, _in(*KV_CACHE_DTYPES)),
    ("tp_size", lambda c: c.tp_size >= 1, _want(">= 1")),
    (
        "speculative_algorithm",
        lambda c: c.speculative_algorithm in (None, "ngram", "draft"),
        _want("None, ngram or draft"),
    ),
    (
        "speculative_draft_model",
        lambda c: (c.speculative_algorithm == "draft") == (c.speculative_draft_model is not None),
        _want("required with speculative_algorithm=draft, and only then"),
    ),
    (
        "speculative_draft_model",
        lambda c: c.speculative_draft_model is None or c.tp_size == 1,
        _want("not supported with tp_size > 1 yet"),
    ),
    ("speculative_num_steps", lambda c: 1 <= c.speculative_num_steps <= 16, _want("in [1, 16]")),
    ("nnodes", lambda c: c.nnodes >= 1, _want(">= 1")),
    ("nnodes", lambda c: c.tp_size % c.nnodes == 0, _want("must divide tp_size={c.tp_size}")),
    ("node_rank", lambda c: 0 <= c.node_rank < c.nnodes, _want("in [0, nnodes={c.nnodes})")),
    (
        "dist_init_addr",
        lambda c: c.dist_init_addr is None or _host_port_ok(c.dist_init_addr),
        _want("host:port with a port in 1..65535"),
    ),
    (
        "dist_init_addr",
        lambda c: c.nnodes == 1 or c.dist_init_addr is not None,
        _want("required (rank 0's host:port) when nnodes > 1"),
    ),
    ("mem_fraction_static", lambda c: 0.0 < c.mem_fraction_static < 1.0, _want("in (0, 1)")),
    ("context_length", lambda c: _at_least(c.context_length, 2), _want(">= 2")),
]


# ---------------------------------------------------------------- extension option groups
@dataclass(frozen=True)
class OptionGroup:
    """Options an extension adds: ``options`` is a frozen dataclass whose fields (made with
    `option`) become flags and keywords; ``check`` validates the whole configuration once it
    is built (ValueError naming the field). ``server``: server flags (command line only, in
    `ServerArgs.extensions`) rather than engine options."""

    title: str
    options: type
    check: Callable[[EngineConfig], None] = lambda config: None
    server: bool = False


_groups: list[OptionGroup] = []


def register_options(group: OptionGroup) -> None:
    _groups.append(group)


def option_groups() -> list[OptionGroup]:
    """Every registered group, the extensions loaded first."""
    from minisgl.extension_loader import load_extensions

    load_extensions()
    return list(_groups)


def option_names(kind: type) -> list[str]:
    return [f.name for f in dataclasses.fields(kind) if not f.metadata.get("internal")]


def _pick(kind: type, values: dict[str, Any]) -> dict[str, Any]:
    return {n: values[n] for n in option_names(kind) if n in values}


def _build(kind: type[C], values: dict[str, Any]) -> C:
    return kind(**_pick(kind, values))


def _loaded_note() -> str:
    from minisgl.extension_loader import loaded_extensions

    names = loaded_extensions()
    return f" (extensions loaded: {', '.join(names) or 'none'})"


# ---------------------------------------------------------------- command-line flags
def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(annotation: Any) -> type:
    """int for `int | None`, etc."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return args[0]  # type: ignore[no-any-return]
    return annotation  # type: ignore[no-any-return]


def add_flags(parser: argparse.ArgumentParser, kind: type, title: str) -> None:
    """One flag per field of the dataclass ``kind`` (see `option`)."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(kind)
    for f in dataclasses.fields(kind):
        if f.metadata.get("internal"):
            continue
        names = [_flag(f.name), *f.metadata.get("aliases", ())]
        help_text = f.metadata.get("help", "")
        base = _base_type(hints[f.name])
        if base is bool:
            # A False default is a plain switch; a True default also gets --no-<flag>.
            action = argparse.BooleanOptionalAction if f.default else "store_true"
            group.add_argument(
                *names, dest=f.name, action=action, default=f.default, help=help_text
            )
            continue
        if "default" not in help_text:
            help_text = f"{help_text} (default: {f.default})".strip()
        meta = base.__name__.upper()
        group.add_argument(
            *names, dest=f.name, type=base, default=f.default, metavar=meta, help=help_text
        )


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The core's engine flags and those of every registered engine option group."""
    add_flags(parser, EngineConfig, "engine")
    for g in option_groups():
        if not g.server:
            add_flags(parser, g.options, g.title)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    names = set(option_names(EngineConfig))
    for g in option_groups():
        if not g.server:
            names |= set(option_names(g.options))
    return EngineConfig.from_kwargs(**{n: getattr(args, n) for n in names})
