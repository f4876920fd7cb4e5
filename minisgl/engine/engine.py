"""The engine: loads the model, owns the KV pool and page table, runs one forward step."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minisgl.attention.base import AttentionBackend, BatchLayout, ForwardBatch
from minisgl.attention.registry import make_backend
from minisgl.config import EngineConfig
from minisgl.distributed import TPInfo
from minisgl.engine.cuda_graph import CudaGraphRunner
from minisgl.engine.logit_mask import apply_token_bitmask
from minisgl.engine.sampler import (
    PenaltyState,
    SampleOutput,
    Sampler,
    SamplingBatch,
    SamplingRows,
)
from minisgl.kernels.staging import DeviceStager
from minisgl.kvcache.kv_dtype import kv_cache_dtype
from minisgl.kvcache.pool import KVPool
from minisgl.layers.cpu_linear import pack_model
from minisgl.models.config import ModelConfig
from minisgl.models.loader import (
    iter_dummy_weights,
    iter_safetensors,
    load_weights,
)
from minisgl.models.registry import build_model
from minisgl.models.resolve import ResolvedModel, resolve_model_path
from minisgl.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def read_hf_config(resolved: ResolvedModel) -> dict[str, Any]:
    if resolved.kind == "gguf":
        from minisgl.models.gguf_loader import gguf_hf_config

        return gguf_hf_config(resolved.path)
    cfg = json.loads((resolved.path / "config.json").read_text())
    gen = resolved.path / "generation_config.json"
    if gen.exists():
        # Instruct models list their end-of-turn ids here; HF generate stops on them too.
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            cfg["eos_token_id"] = eos
    return dict(cfg)


class Engine:
    def __init__(
        self, config: EngineConfig, tp: TPInfo | None = None, share: Engine | None = None
    ) -> None:
        """``share``: the target engine, when this one is its draft model. The draft then
        uses the target's page table, so each token's K/V sits at the same slot index in
        both pools, and its pool has as many pages as the target's."""
        self.config = config
        self.tp = tp or TPInfo()
        if self.tp.size != config.tp_size:
            raise ValueError(f"tp_size={config.tp_size} needs Engine(config, TPInfo(rank, size))")
        self.device = pick_device(config.device)
        if self.tp.size > 1:
            from minisgl.distributed.group import init_tp_group, rank_device

            # Each rank gets its own GPU (cuda:{local rank}); then join the groups: weight
            # loading needs none, but sizing the KV pool below is a collective.
            self.device = rank_device(config, self.tp, self.device)
            init_tp_group(config, self.tp, self.device)
        elif self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", 0)
        if config.dtype == "auto":
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            self.dtype = _DTYPES[config.dtype]
        # The KV pool's element type: the model's, or fp8 (1 byte: the pool sizing below
        # then fits twice a bf16 pool's pages in the same budget).
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.resolved = resolve_model_path(config.model)
        self.hf_config = read_hf_config(self.resolved)
        self.model_config = ModelConfig.from_dict(self.hf_config)
        cfg = self.model_config
        # An explicit context_length may exceed the model's (as SGLang's --context-length).
        self.context_length = config.context_length or cfg.max_position
        self.max_running_requests = config.max_running_requests or (
            1024 if self.device.type == "cuda" else 256
        )
        self.chunked_prefill_size = config.chunked_prefill_size or (
            8192 if self.device.type == "cuda" else 256
        )
        torch.manual_seed(config.seed)
        with _default_dtype(self.dtype), torch.device(self.device):
            self.model = build_model(cfg, self.tp, max(self.context_length, cfg.max_position))
        self.model.eval()
        self._load_weights()
        pack_model(self.model)  # CPU: weights reordered for oneDNN (see layers/cpu_linear.py)
        self.pool = self._make_pool()
        # The context cannot exceed what the pool holds (minus one page of slack).
        self.context_length = min(self.context_length, (self.pool.num_pages - 1) * config.page_size)
        rows = self.max_running_requests + 1  # the extra row is scratch for padding
        # The pool has one page more than the allocator hands out: padding rows of CUDA-graph
        # batches read and write it, and the spare page-table row points at it.
        self.scratch_slot = self.pool.num_pages * config.page_size
        self.page_table: torch.Tensor
        if share is not None:
            self.context_length = share.context_length
            self.page_table = share.page_table
        else:
            width = self.context_length + config.page_size
            self.page_table = torch.zeros(rows, width, dtype=torch.int64, device=self.device)
            self.page_table[-1].fill_(self.scratch_slot)
        self.stager = DeviceStager(self.device)
        self.attn_backend = self._make_backend()
        self.sampler = Sampler(use_triton=self.device.type == "cuda")
        self.penalties = PenaltyState(rows, cfg.vocab_size, self.device)
        # The token each table row sampled last: the next decode's input under overlap.
        self.last_tokens = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.graph_runner = self._make_graph_runner()
        if self.device.type == "cuda":
            self._warm_up_sampler()

    # ---------------------------------------------------------------- setup
    def _load_weights(self) -> None:
        fmt = self.config.load_format
        if fmt == "dummy":
            # One full random checkpoint, of which every TP rank loads its shard.
            dummy = iter_dummy_weights(self.hf_config, self.device, self.dtype, self.config.seed)
            load_weights(self.model, dummy)
            return
        if self.resolved.kind == "gguf":
            from minisgl.models.gguf_loader import iter_gguf_weights

            load_weights(self.model, iter_gguf_weights(self.resolved.path, self.dtype))
        else:
            load_weights(self.model, iter_safetensors(Path(self.resolved.path), self.device))

    def _make_pool(self) -> KVPool:
        cfg, c = self.model_config, self.config
        kv_heads = self.model.local_kv_heads
        per_page = KVPool.bytes_per_page(
            cfg.num_layers, c.page_size, kv_heads, cfg.head_dim, self.kv_dtype
        )
        if c.num_pages is not None:
            num_pages = c.num_pages
        else:
            # A draft model, loaded later, needs room for its weights and a page per page here.
            draft_weights, draft_page = 0, 0
            if c.speculative_draft_model is not None:
                from minisgl.speculative.draft_model import draft_footprint

                draft_weights, draft_page = draft_footprint(c, self.dtype, self.kv_dtype)
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                used = total - free
                budget = int(total * c.mem_fraction_static) - used - draft_weights
                short = (
                    f"{used / 2**30:.1f} of {total / 2**30:.1f} GiB of {self.device} are in use "
                    f"(weights, or another process or engine) and mem_fraction_static="
                    f"{c.mem_fraction_static} caps the total: free that memory or raise it"
                )
            else:
                budget = int(c.cpu_kv_cache_gb * (1 << 30))
                short = f"cpu_kv_cache_gb={c.cpu_kv_cache_gb} is too small: raise it"
            per_page += draft_page
            if budget < 2 * per_page:
                # Else the pool shrinks to its 2-page minimum and every prompt is "too long"
                # for a context of one page: fail at startup, saying why.
                raise ValueError(
                    f"no memory left for the KV cache ({max(budget, 0) / 2**20:.1f} MiB, "
                    f"need at least {2 * per_page / 2**20:.2f}): {short}"
                )
            # Never more than every request at full context could use.
            want = self.max_running_requests * self.context_length // c.page_size + 1
            num_pages = max(2, min(budget // per_page, want))
        if self.tp.size > 1:
            t = torch.tensor(
                [num_pages], device=self.device if self.device.type == "cuda" else "cpu"
            )
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
            num_pages = int(t.item())
        logger.info(
            "KV pool: %d pages of %d tokens (%.2f GiB, %s)",
            num_pages,
            c.page_size,
            num_pages * per_page / 2**30,
            str(self.kv_dtype).removeprefix("torch."),
        )
        pool = KVPool(
            cfg.num_layers,
            num_pages + 1,
            c.page_size,
            kv_heads,
            cfg.head_dim,
            self.kv_dtype,
            self.device,
        )
        pool.num_pages = num_pages  # usable pages; the extra one is the scratch page
        return pool

    def _make_backend(self) -> AttentionBackend:
        # Fused only on CUDA: there the unfused layers run the same Triton kernels, so the
        # switch never changes outputs (on CPU they fall back to torch).
        fused = self.device.type == "cuda" and not self.config.disable_fused_rope_store
        name = self.config.attention_backend
        return make_backend(name, self.pool, self.device, self.stager, fused)

    @torch.inference_mode()
    def _warm_up_sampler(self) -> None:
        """Compile the sampler's kernels for every launch shape they take (greedy,
        temperature, top-k; few and many rows) before serving: a compile in the middle of a
        run stalls every request in flight."""
        hidden = torch.zeros(1, self.model_config.hidden_size, dtype=self.dtype, device=self.device)
        model: Any = self.model
        vocab = model.logits(hidden).shape[1]  # the LM head's width (TP may pad it)
        kinds = (
            SamplingParams(temperature=0),
            SamplingParams(temperature=0.7),
            SamplingParams(temperature=0.7, top_k=40, top_p=0.9),
        )
        for rows in (1, 16, 256):
            logits = torch.zeros(rows, vocab, dtype=self.dtype, device=self.device)
            for params in kinds:
                batch = SamplingBatch.build([params] * rows, [0] * rows, [0] * rows, self.device)
                self.sampler.sample(logits, batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _make_graph_runner(self) -> CudaGraphRunner | None:
        c = self.config
        if self.device.type != "cuda" or c.cuda_graph_max_bs == 0:
            return None
        if not hasattr(self.attn_backend, "graph_capturable"):
            logger.warning("CUDA graphs need the triton attention backend; running eagerly")
            return None
        max_bs = c.cuda_graph_max_bs
        if max_bs is None:
            total = torch.cuda.get_device_properties(self.device).total_memory
            max_bs = 256 if total > 80 * 2**30 else 160
        max_tokens = 2048 if c.cuda_graph_max_tokens is None else c.cuda_graph_max_tokens
        return CudaGraphRunner(self, min(max_bs, self.max_running_requests), max_tokens)

    # ---------------------------------------------------------------- step
    def to_device(
        self, values: list[int] | torch.Tensor, dtype: torch.dtype = torch.long
    ) -> torch.Tensor:
        t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            # Pinned staging keeps the copy asynchronous, so the host never waits here.
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    @torch.inference_mode()
    def forward(
        self,
        layout: BatchLayout,
        input_ids: list[int],
        positions: torch.Tensor,
        out_slots: torch.Tensor,
        sample_rows: list[int],
        sampling: SamplingRows | None,
        use_penalties: bool = False,
        from_device: list[tuple[int, int]] = (),  # type: ignore[assignment]
        sample_table_rows: list[int] = (),  # type: ignore[assignment]
        prompt_lp: PromptLogprobRequest | None = None,
        spec: SpecRequest | None = None,
        sample_steps: Sequence[int] = (),
        token_bitmask: torch.Tensor | None = None,
    ) -> SampleResult | None:
        """Run the model on a batch and sample for the rows in ``sample_rows``.

        ``sampling`` holds the sampling rows' parameters, ``sample_steps`` the output index
        each of them samples, ``sample_table_rows`` their page-table rows (which also index
        penalty state when ``use_penalties``). ``from_device`` lists (flat position, table
        row) pairs whose input token is the one the previous batch sampled for that row: it
        is read from ``last_tokens`` on the device, so a batch can be launched before the
        previous one's samples reach the host. ``token_bitmask`` (host int32, a row per
        sampling row; scheduler/grammar.py) limits each row to the tokens whose bits are set.
        """
        ends = np.cumsum(layout.extend_lens) - 1
        index_parts = [ends[np.asarray(sample_rows, dtype=np.int64)]]
        if prompt_lp is not None:
            # Prompt positions whose logits score the next prompt token ride along after
            # the sampling rows' last tokens.
            index_parts.append(np.asarray(prompt_lp.index, dtype=np.int64))
        if spec is not None:
            index_parts.append(np.asarray(spec.index, dtype=np.int64))
        logits_index = np.concatenate(index_parts)
        pos_dev, rows_dev = zip(*from_device) if from_device else ((), ())
        fill, fill_src = (spec.fill, spec.fill_src) if spec is not None else ((), ())
        # Every index this step needs travels in one pinned buffer and one copy.
        staged = self.stager.stage(
            [
                input_ids, positions, out_slots, logits_index, pos_dev, rows_dev,
                sample_table_rows, sample_steps, fill, fill_src,
            ],
            torch.long,
        )  # fmt: skip
        ids, pos, slots, logits_idx, fd_pos, fd_rows, sample_rows_dev, steps_dev = staged[:8]
        fill_dev, src_dev = staged[8:]
        if from_device:
            ids[fd_pos] = self.last_tokens[fd_rows]
        if spec is not None and fill:
            # Draft tokens may exist only on the device (a draft model's samples).
            ids[fill_dev] = spec.drafts.view(-1)[src_dev]
        every_row_samples = len(sample_rows) == len(layout.req_rows)
        graph_ok = prompt_lp is None and spec is None and every_row_samples
        logits = self.run_model(layout, ids, pos, slots, logits_idx, graph_ok)
        extra: list[torch.Tensor | None] = [None] * 5
        n_sample = len(sample_rows)
        if spec is not None:
            n_spec = len(spec.index)
            extra[3:] = _verify_drafts(logits[len(logits) - n_spec :], spec, self.device)
            logits = logits[: len(logits) - n_spec]
        if prompt_lp is not None:
            extra[:3] = _prompt_logprobs(logits[n_sample:], prompt_lp, self.device)
            logits = logits[:n_sample]
        if not sample_rows or sampling is None:
            if prompt_lp is None and spec is None:
                return None
            return SampleResult.start_copy(None, extra)
        if token_bitmask is not None:
            logits = apply_token_bitmask(logits, self.to_device(token_bitmask))
        penalty_slots = sample_rows_dev if use_penalties else None
        out = self.sampler.sample(
            logits,
            sampling.batch(steps_dev),
            self.penalties if use_penalties else None,
            penalty_slots,
        )
        self.last_tokens[sample_rows_dev] = out.next_tokens
        if penalty_slots is not None:
            self.penalties.add_tokens(penalty_slots, out.next_tokens)
        return SampleResult.start_copy(out, extra)

    def run_model(
        self,
        layout: BatchLayout,
        ids: torch.Tensor,
        pos: torch.Tensor,
        slots: torch.Tensor,
        logits_index: torch.Tensor,
        graph_ok: bool,
    ) -> torch.Tensor:
        """Logits at ``logits_index``, in the model's dtype (consumers upcast), for a batch
        whose tensors are on the device.
        ``graph_ok``: the logits wanted are every row's, in order, so a decode batch may
        replay a captured CUDA graph."""
        runner = self.graph_runner
        if runner is not None:
            if graph_ok and runner.can_run(layout):
                return runner.run(layout, ids, pos, slots)
            if runner.can_run_extend(layout, logits_index.shape[0]):
                return runner.run_extend(layout, ids, pos, slots, logits_index)
        batch = ForwardBatch(
            input_ids=ids,
            positions=pos,
            out_slots=slots,
            attn_backend=self.attn_backend,
            attn_metadata=self.attn_backend.prepare(layout, self.device),
            logits_index=logits_index,
        )
        return self.model(batch)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class PromptLogprobRequest:
    index: list[int]  # flat token positions whose logits are scored
    targets: list[int]  # the prompt token that follows each position
    top_k: int  # alternatives to return per position (0 = only the prompt token's)


def _prompt_logprobs(
    logits: torch.Tensor, req: PromptLogprobRequest, device: torch.device
) -> list[torch.Tensor | None]:
    logp = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(req.targets, dtype=torch.long).to(device, non_blocking=True)
    chosen = logp.gather(1, targets[:, None])[:, 0]
    if req.top_k:
        top = logp.topk(req.top_k, dim=-1)
        return [chosen, top.indices, top.values]
    return [chosen, None, None]


@dataclass(frozen=True)
class SpecRequest:
    index: list[int]  # k + 1 flat positions per speculating row
    drafts: torch.Tensor  # [B, K] draft tokens on the device, -1 where a row drafted fewer
    draft_probs: torch.Tensor | None  # [B, K, V] the draft's distributions; None: one-hot
    fill: list[int]  # flat input positions that take the draft tokens, row by row
    fill_src: list[int]  # their flat indices into ``drafts``
    temperatures: list[float]  # 0 = greedy
    seeds: list[int]
    steps: list[int]  # output position of each row's first new token


def _verify_drafts(
    logits: torch.Tensor, spec: SpecRequest, device: torch.device
) -> list[torch.Tensor | None]:
    from minisgl.speculative.verify import verify, verify_greedy

    rows = len(spec.temperatures)
    logits = logits.view(rows, -1, logits.shape[-1])
    if not any(spec.temperatures):
        # Greedy rows need neither probabilities nor noise: what rejection sampling with
        # one-hot targets would emit, at a fraction of the cost (this runs every step).
        return list(verify_greedy(logits, spec.drafts))
    temps = torch.tensor(spec.temperatures, dtype=torch.float32).to(device)
    greedy = temps == 0
    scale = torch.where(greedy, torch.ones_like(temps), temps)
    probs = torch.softmax(logits.float() / scale[:, None, None], dim=-1)
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(probs.dtype)
    probs = torch.where(greedy[:, None, None], one_hot, probs)
    seeds = torch.tensor([_as_i64(x) for x in spec.seeds], dtype=torch.long).to(device)
    tokens, counts = verify(
        probs,
        spec.drafts,
        spec.draft_probs,
        seeds,
        torch.tensor(spec.steps, dtype=torch.long).to(device),
    )
    return [tokens, counts]


def _as_i64(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


@dataclass
class HostSamples:
    next_tokens: list[int]
    chosen_logprobs: list[float] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None
    prompt_logprobs: list[float] | None = None
    prompt_top_ids: list[list[int]] | None = None
    prompt_top_logprobs: list[list[float]] | None = None
    spec_tokens: list[list[int]] | None = None
    spec_counts: list[int] | None = None


class SampleResult:
    """Samples of one batch, on their way to the host (a non-blocking copy plus an event)."""

    def __init__(self, tensors: list[torch.Tensor | None], event: torch.cuda.Event | None) -> None:
        self.tensors = tensors
        self.event = event

    @classmethod
    def start_copy(
        cls, out: SampleOutput | None, prompt: list[torch.Tensor | None] | None = None
    ) -> SampleResult:
        tensors: list[torch.Tensor | None] = (
            [out.next_tokens, out.chosen_logprobs, out.top_logprob_ids, out.top_logprobs]
            if out is not None
            else [None, None, None, None]
        )
        tensors += prompt or [None] * 5
        if not any(t is not None and t.device.type == "cuda" for t in tensors):
            return cls(tensors, None)
        host = [t.to("cpu", non_blocking=True) if t is not None else None for t in tensors]
        event = torch.cuda.Event()
        event.record()
        return cls(host, event)

    def to_host(self) -> HostSamples:
        if self.event is not None:
            self.event.synchronize()
        lists = [t.tolist() if t is not None else None for t in self.tensors]
        return HostSamples(lists[0] or [], *lists[1:])
