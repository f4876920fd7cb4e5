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
import os
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

C = TypeVar("C")
T = TypeVar("T")

# --kv-cache-dtype values (minisgl/kvcache/kv_dtype.py maps them to torch dtypes); "fp8" is
# vLLM's spelling of fp8_e4m3.
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "fp8")


def option(
    default: T, help: str, *aliases: str, choices: tuple[str, ...] = (), low: float | None = None
) -> T:
    """A configuration field: its default, its --help text, extra flag spellings, and what a
    valid value is (``choices``, or at least ``low``; None always means "auto")."""
    meta = {"help": help, "aliases": aliases, "choices": choices, "low": low}
    return field(default=default, metadata=meta)


def check_fields(options: object) -> None:
    """ValueError naming the first field of a dataclass of `option` fields outside its
    ``choices`` or under its ``low``."""
    for f in dataclasses.fields(options):  # type: ignore[arg-type]
        value, choices, low = (
            getattr(options, f.name),
            f.metadata.get("choices"),
            f.metadata.get("low"),
        )
        if value is None:
            continue
        if choices and value not in choices:
            want = ", ".join(choices[:-1]) + f" or {choices[-1]}"
            raise ValueError(f"{f.name}={value!r} is invalid: {want}")
        if low is not None and value < low:
            raise ValueError(f"{f.name}={value!r} is invalid: >= {low:g}")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = option(
        None,
        "local directory, .gguf file, or Hugging Face id (default: bundled SmolLM2-135M)",
        "--model-path",
    )
    tokenizer: str | None = option(None, "tokenizer to use instead of the model's")
    load_format: str = option(
        "auto",
        "auto | safetensors | gguf | dummy (random weights)",
        choices=("auto", "safetensors", "gguf", "dummy"),
    )
    dtype: str = option(
        "auto",
        "auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    device: str = option("auto", "auto | cpu | cuda | cuda:N")
    seed: int = option(0, "engine seed (requests without a seed draw theirs from it)")
    context_length: int | None = option(
        None, "cap on prompt + output tokens per request", "--max-model-len", low=2
    )
    page_size: int = option(1, "tokens per KV page", low=1)
    # fp8 holds twice a bf16 pool's tokens in the same memory (scale 1.0, saturating stores).
    kv_cache_dtype: str = option(
        "auto",
        "KV cache element type: auto (the model's dtype) | fp8_e4m3 (alias fp8) | fp8_e5m2 "
        "(1 byte per element: about twice the tokens of a bf16 cache)",
        choices=KV_CACHE_DTYPES,
    )
    num_pages: int | None = option(
        None, "KV pool size in pages (default: from the memory budget)", low=2
    )
    mem_fraction_static: float = option(0.85, "GPU: share of device memory for weights + KV cache")
    cpu_kv_cache_gb: float = option(1.0, "CPU: KV pool budget in GiB")
    cpu_threads: int | None = option(
        None,
        "CPU: threads of the engine, its TP ranks' together (default: the physical cores, or "
        "OMP_NUM_THREADS where that is fewer)",
        low=1,
    )
    # None: 1024 on CUDA (a wave of admissions rarely waits for a slot: measured on the H200
    # shared-prefix benchmark, benchmark/RESULTS.md), 256 on CPU.
    max_running_requests: int | None = option(None, "most requests decoded at once", low=1)
    # None: 8192 on CUDA; 256 on CPU, where a big prefill step stalls every running stream
    # for its whole length (p99 ITL about halved at equal throughput, RESULTS.md).
    chunked_prefill_size: int | None = option(
        None, "token budget per scheduler step (default 8192 on CUDA, 256 on CPU)", low=1
    )
    # Prefill goes first: running decodes wait while any prompt has tokens left to prefill
    # (tests/unit/scheduler/test_policies.py).
    disable_mixed_batch: bool = option(
        False,
        "never mix prefill chunks with decodes in one batch (prefill goes first: decodes wait "
        "while a prompt is prefilled)",
    )
    cache: str = option(
        "radix", "prefix cache: radix | naive", "--cache-type", choices=("radix", "naive")
    )
    schedule_policy: str = option(
        "fcfs",
        "fcfs | lpm (longest prefix match first) | priority (each request's priority field, "
        "lower values first; ties by arrival)",
        "--scheduling-policy",
        choices=("fcfs", "lpm", "priority"),
    )
    attention_backend: str = option("auto", "auto | torch | triton | flashinfer", "--attn")
    cuda_graph_max_bs: int | None = option(
        None, "largest CUDA-graph batch size (0 disables CUDA graphs)"
    )
    cuda_graph_max_tokens: int | None = option(
        None,
        "prefill/mixed steps up to this many tokens replay CUDA graphs (default 2048; 0 runs "
        "them eagerly)",
        low=0,
    )
    disable_overlap_scheduling: bool = option(
        False, "run CPU scheduling and device compute one after the other"
    )
    disable_fused_rope_store: bool = option(
        False,
        "run q/k norm, RoPE and the KV-cache store as separate kernels (CUDA; outputs are "
        "identical either way)",
    )
    disable_fused_silu_down: bool = option(
        False,
        "run SiLU-and-mul as its own kernel instead of inside the down projection's batch-1 "
        "GEMV (CUDA, bf16 and FP8; the same bits either way)",
    )
    disable_fused_norm_gemv: bool = option(
        False,
        "run each decoder layer's pre-norms as their own kernels instead of inside the batch-1 "
        "GEMV (bf16, FP8) of the q/k/v and gate/up projections (CUDA, TP 1; the fused path "
        "sums 1 / rms in another order)",
    )
    disable_fused_decode_rope: bool = option(
        False,
        "at pure decode steps, run q/k norm, RoPE and the KV-cache store as their own kernel "
        "instead of inside the decode attention kernel (CUDA, with the fused rope store; the "
        "folded path sums 1 / rms in another order)",
    )
    tp_size: int = option(1, "tensor-parallel degree", "--tp", "--tensor-parallel-size", low=1)
    # Multi-node TP (SGLang's names): tp_size // nnodes ranks per node; node 0 holds rank 0
    # and is the only one that serves HTTP.
    nnodes: int = option(1, "nodes of a multi-node TP run", low=1)
    node_rank: int = option(0, "this node's index in a multi-node TP run")
    dist_init_addr: str | None = option(
        None, "rank 0's host:port for the rendezvous (default on one node: a free local port)"
    )
    init_new_token_ratio: float = option(
        0.7, "admission: expected share of max_tokens still to come, at first"
    )
    min_new_token_ratio: float = option(0.1, "admission: the floor that share decays to")
    # The option groups of extensions, one instance each (see OptionGroup).
    extensions: tuple[object, ...] = field(default=(), metadata={"internal": True})

    def __post_init__(self) -> None:
        # One instance of every registered group, in registration order: equal options give
        # equal configurations (TP ranks compare theirs), given or defaulted.
        given = {type(e): e for e in self.extensions}
        groups = [g.options for g in option_groups(server=False)]
        exts = tuple(given.pop(kind, None) or kind() for kind in groups)
        if given:
            raise ValueError(f"extensions holds unregistered options: {sorted(map(str, given))}")
        object.__setattr__(self, "extensions", exts)
        check_fields(self)
        for name, ok, want in _CHECKS:
            if not ok(self):
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is invalid: {want.format(c=self)}"
                )

    def ext(self, kind: type[C]) -> C:
        """The options of one extension's group (its defaults if it was not given)."""
        return group_of(self.extensions, kind)

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        """The configuration from flat keywords: the core's fields and every registered
        extension group's; ValueError naming any keyword nobody takes."""
        groups = option_groups(server=False)
        unknown = set(kwargs) - set(engine_option_names())
        if unknown:
            raise ValueError(f"unknown option(s): {', '.join(sorted(unknown))}{_loaded_note()}")
        exts: tuple[object, ...] = tuple(_build(g.options, kwargs) for g in groups)
        for ext in exts:
            check_fields(ext)
        config = _build(cls, kwargs, extensions=exts)
        for g in groups:
            g.check(config)
        return config


def _host_port_ok(addr: str) -> bool:
    host, sep, port = addr.rpartition(":")
    return bool(sep and host.strip("[]") and port.isdigit() and 1 <= int(port) <= 65535)


# (field, test, what a valid value is): the checks that relate fields, after check_fields.
_CHECKS: list[tuple[str, Callable[[EngineConfig], bool], str]] = [
    ("nnodes", lambda c: c.tp_size % c.nnodes == 0, "must divide tp_size={c.tp_size}"),
    ("node_rank", lambda c: 0 <= c.node_rank < c.nnodes, "in [0, nnodes={c.nnodes})"),
    (
        "dist_init_addr",
        lambda c: c.dist_init_addr is None or _host_port_ok(c.dist_init_addr),
        "host:port with a port in 1..65535",
    ),
    (
        "dist_init_addr",
        lambda c: c.nnodes == 1 or c.dist_init_addr is not None,
        "required (rank 0's host:port) when nnodes > 1",
    ),
    ("mem_fraction_static", lambda c: 0.0 < c.mem_fraction_static < 1.0, "in (0, 1)"),
    (
        "cpu_threads",
        lambda c: c.cpu_threads is None or c.cpu_threads <= len(os.sched_getaffinity(0)),
        f"at most the {len(os.sched_getaffinity(0))} CPUs this process may run on",
    ),
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


def option_groups(server: bool | None = None) -> list[OptionGroup]:
    """Every registered group (``server``: only the server's, or only the engine's), the
    extensions loaded first."""
    from minisgl.extension_loader import load_extensions

    load_extensions()
    return [g for g in _groups if server is None or g.server == server]


def group_of(groups: tuple[object, ...], kind: type[C]) -> C:
    """The instance of ``kind`` among ``groups``, else ``kind``'s defaults."""
    return next((g for g in groups if isinstance(g, kind)), None) or kind()


def option_names(kind: type) -> list[str]:
    return [f.name for f in dataclasses.fields(kind) if not f.metadata.get("internal")]


def _build(kind: type[C], values: dict[str, object], **internal: object) -> C:
    """``kind`` from the entries of ``values`` that name its options (the caller checked
    that no other entry is left)."""
    return kind(**{n: values[n] for n in option_names(kind) if n in values}, **internal)


def _loaded_note() -> str:
    from minisgl.extension_loader import loaded_extensions

    names = loaded_extensions()
    return f" (extensions loaded: {', '.join(names) or 'none'})"


# ---------------------------------------------------------------- command-line flags
def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(annotation: object) -> type:
    """int for `int | None`, etc."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    assert isinstance(annotation, type), annotation
    return annotation


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
    for g in option_groups(server=False):
        add_flags(parser, g.options, g.title)


def engine_option_names() -> list[str]:
    """The core's options and those of every registered engine option group."""
    kinds = [EngineConfig, *(g.options for g in option_groups(server=False))]
    return [name for kind in kinds for name in option_names(kind)]


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_kwargs(**{n: getattr(args, n) for n in engine_option_names()})
