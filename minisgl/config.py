"""Frozen configuration dataclasses. The CLI flags and the LLM(...) keyword arguments are
generated from these fields, so every option has one name everywhere."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# --kv-cache-dtype values (minisgl/kvcache/kv_dtype.py maps them to torch dtypes); "fp8" is
# vLLM's spelling of fp8_e4m3.
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "fp8")
# --schedule-policy values; "priority" orders by each request's priority (scheduler/policy.py).
SCHEDULE_POLICIES = ("fcfs", "lpm", "priority")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # local dir, .gguf file, or HF id; None = bundled SmolLM2-135M
    tokenizer: str | None = None
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    seed: int = 0
    context_length: int | None = None  # cap on prompt + output tokens per request
    page_size: int = 1
    # KV pool element type: auto (the model's dtype) | fp8_e4m3 (alias fp8) | fp8_e5m2. fp8
    # holds twice a bf16 pool's tokens in the same memory (scale 1.0, saturating stores).
    kv_cache_dtype: str = "auto"
    num_pages: int | None = None  # KV pool size in pages; default from the memory budget
    mem_fraction_static: float = 0.85  # GPU: share of device memory for weights + KV
    cpu_kv_cache_gb: float = 1.0  # CPU: KV pool budget
    # None = auto: 1024 on CUDA (a wave of admissions rarely waits for a slot: measured on
    # the H200 shared-prefix benchmark, see benchmark/RESULTS.md), 256 on CPU.
    max_running_requests: int | None = None
    # Token budget per step. None = auto: 8192 on CUDA; 256 on CPU, where a big prefill step
    # stalls every running stream for its whole length (measured: p99 ITL about halved at
    # equal throughput, benchmark/RESULTS.md).
    chunked_prefill_size: int | None = None
    # Never a decode and a prefill chunk in one step. Prefill goes first: running decodes
    # wait while any prompt has tokens left to prefill (a long chunked prompt stalls every
    # stream for all its chunks; tests/unit/test_scheduler_policies.py).
    disable_mixed_batch: bool = False
    cache: str = "radix"  # radix | naive
    # fcfs | lpm | priority (each request's `priority`, lower first; vLLM's convention)
    schedule_policy: str = "fcfs"
    attention_backend: str = "auto"  # auto | torch | triton | flashinfer
    cuda_graph_max_bs: int | None = None  # None = auto; 0 disables CUDA graphs
    # Prefill/mixed steps of up to this many new tokens replay CUDA graphs too (padded to
    # the next captured count). None = auto (2048 on CUDA); 0 runs them eagerly.
    cuda_graph_max_tokens: int | None = None
    disable_overlap_scheduling: bool = False
    # CUDA: q/k norm, RoPE and the K/V store run as one kernel per layer (bit-identical).
    disable_fused_rope_store: bool = False
    tp_size: int = 1
    # CUDA TP: small all-reduces (decode steps) through GPU peer memory instead of NCCL.
    disable_custom_all_reduce: bool = False
    # Multi-node TP (SGLang's names): tp_size // nnodes ranks per node; node 0 holds rank 0
    # and is the only one that serves HTTP. dist_init_addr is rank 0's host:port for the
    # rendezvous (default on one node: 127.0.0.1 and a free port).
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    # Speculative decoding: "ngram" drafts from the request's own tokens (prompt lookup);
    # "draft" runs a small draft model with the same vocabulary (implied by a draft model).
    speculative_algorithm: str | None = None
    speculative_num_steps: int = 4  # draft tokens proposed per request per step
    speculative_draft_model: str | None = None  # local dir, .gguf file or HF id
    init_new_token_ratio: float = 0.7  # admission: expected share of max_tokens still to come
    min_new_token_ratio: float = 0.1

    def __post_init__(self) -> None:
        _check(self.page_size >= 1, "page_size", self.page_size, "must be >= 1")
        _check(self.num_pages is None or self.num_pages >= 2, "num_pages", self.num_pages, ">= 2")
        _check(
            self.max_running_requests is None or self.max_running_requests >= 1,
            "max_running_requests",
            self.max_running_requests,
            ">= 1",
        )
        _check(
            self.cuda_graph_max_tokens is None or self.cuda_graph_max_tokens >= 0,
            "cuda_graph_max_tokens",
            self.cuda_graph_max_tokens,
            ">= 0",
        )
        _check(
            self.chunked_prefill_size is None or self.chunked_prefill_size >= 1,
            "chunked_prefill_size",
            self.chunked_prefill_size,
            ">= 1",
        )
        _check(self.cache in ("radix", "naive"), "cache", self.cache, "radix or naive")
        _check(
            self.schedule_policy in SCHEDULE_POLICIES,
            "schedule_policy",
            self.schedule_policy,
            "fcfs, lpm or priority",
        )
        _check(
            self.load_format in ("auto", "safetensors", "gguf", "dummy"),
            "load_format",
            self.load_format,
            "auto, safetensors, gguf or dummy",
        )
        _check(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            "dtype",
            self.dtype,
            "auto, float32, bfloat16 or float16",
        )
        _check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            self.kv_cache_dtype,
            ", ".join(KV_CACHE_DTYPES),
        )
        _check(
            self.kv_cache_dtype == "auto" or self.attention_backend != "flashinfer",
            "kv_cache_dtype",
            self.kv_cache_dtype,
            "the flashinfer attention backend supports only auto: use attention_backend "
            "triton or torch with an fp8 KV cache",
        )
        _check(self.tp_size >= 1, "tp_size", self.tp_size, ">= 1")
        if self.speculative_draft_model is not None and self.speculative_algorithm is None:
            object.__setattr__(self, "speculative_algorithm", "draft")
        _check(
            self.speculative_algorithm in (None, "ngram", "draft"),
            "speculative_algorithm",
            self.speculative_algorithm,
            "None, ngram or draft",
        )
        _check(
            (self.speculative_algorithm == "draft") == (self.speculative_draft_model is not None),
            "speculative_draft_model",
            self.speculative_draft_model,
            "required with speculative_algorithm=draft, and only then",
        )
        _check(
            self.speculative_draft_model is None or self.tp_size == 1,
            "speculative_draft_model",
            self.speculative_draft_model,
            "not supported with tp_size > 1 yet",
        )
        _check(
            1 <= self.speculative_num_steps <= 16,
            "speculative_num_steps",
            self.speculative_num_steps,
            "in [1, 16]",
        )
        _check(self.nnodes >= 1, "nnodes", self.nnodes, ">= 1")
        _check(
            self.tp_size % self.nnodes == 0,
            "nnodes",
            self.nnodes,
            f"must divide tp_size={self.tp_size}",
        )
        _check(
            0 <= self.node_rank < self.nnodes,
            "node_rank",
            self.node_rank,
            f"in [0, nnodes={self.nnodes})",
        )
        _check(
            self.dist_init_addr is None or _host_port_ok(self.dist_init_addr),
            "dist_init_addr",
            self.dist_init_addr,
            "host:port with a port in 1..65535",
        )
        _check(
            self.nnodes == 1 or self.dist_init_addr is not None,
            "dist_init_addr",
            self.dist_init_addr,
            "required (rank 0's host:port) when nnodes > 1",
        )
        _check(
            0.0 < self.mem_fraction_static < 1.0,
            "mem_fraction_static",
            self.mem_fraction_static,
            "in (0, 1)",
        )
        _check(
            self.context_length is None or self.context_length >= 2,
            "context_length",
            self.context_length,
            ">= 2",
        )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        names = {f.name for f in fields(cls)}
        unknown = set(kwargs) - names
        if unknown:
            raise ValueError(f"unknown option(s): {', '.join(sorted(unknown))}")
        return cls(**kwargs)


def _host_port_ok(addr: str) -> bool:
    host, sep, port = addr.rpartition(":")
    return bool(sep and host.strip("[]") and port.isdigit() and 1 <= int(port) <= 65535)


def _check(ok: bool, name: str, value: Any, want: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: {want}")
