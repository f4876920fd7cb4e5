"""The engine: loads the model, owns the KV pool and page table, runs one forward step."""

from __future__ import annotations

import logging

import numpy as np
import torch

from minisgl.attention.base import AttentionBackend, BatchLayout, ForwardBatch
from minisgl.attention.registry import make_backend
from minisgl.config import EngineConfig
from minisgl.distributed import TPInfo
from minisgl.distributed.group import share_cpu_threads
from minisgl.engine.cuda_graph import CudaGraphRunner, GraphTarget
from minisgl.engine.logit_mask import apply_token_bitmask
from minisgl.engine.sampler import PenaltyState, SampleOutput, Sampler, SamplingBatch
from minisgl.engine.setup import (
    agree_on_pages,
    default_dtype,
    kv_pool_pages,
    load_model_weights,
    model_dtype,
    pick_device,
    read_hf_config,
)
from minisgl.engine.step import PendingStep, SampleRequest, StepInput
from minisgl.extension_loader import load_extensions
from minisgl.kernels.staging import DeviceStager, Segment
from minisgl.kvcache.allocator import zeroed_page_table
from minisgl.kvcache.kv_dtype import is_fp8, kv_cache_dtype
from minisgl.kvcache.pool import KVPool
from minisgl.layers.cpu_linear import pack_model
from minisgl.models.config import ModelConfig
from minisgl.models.decoder import CausalLM
from minisgl.models.decoder_layer import set_batch1_fusions
from minisgl.models.registry import build_model
from minisgl.models.resolve import resolve_model_path
from minisgl.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["Engine", "pick_device"]


class Engine:
    def __init__(
        self, config: EngineConfig, tp: TPInfo | None = None, share: Engine | None = None
    ) -> None:
        """``share``: another engine whose page table and context this one uses (a draft
        model's engine: each token's K/V then sits at the same slot index in both pools)."""
        load_extensions()  # attention backends, quantization methods, reducers, ...
        self.config = config
        self.tp = tp or TPInfo()
        if self.tp.size != config.tp_size:
            raise ValueError(f"tp_size={config.tp_size} needs Engine(config, TPInfo(rank, size))")
        self.device = self._join_device(pick_device(config.device))
        if share is None:
            share_cpu_threads(config, self.device)
        self.dtype = model_dtype(config.dtype, self.device)
        # The KV pool's element type: the model's, or fp8 (1 byte: the pool sizing then fits
        # twice a bf16 pool's pages in the same budget).
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.resolved = resolve_model_path(config.model)
        self.hf_config = read_hf_config(self.resolved)
        self.model_config = cfg = ModelConfig.from_dict(self.hf_config)
        # An explicit context_length may exceed the model's (as SGLang's --context-length).
        self.context_length = config.context_length or cfg.max_position
        on_cuda = self.device.type == "cuda"
        self.max_running_requests = config.max_running_requests or (1024 if on_cuda else 256)
        self.chunked_prefill_size = config.chunked_prefill_size or (8192 if on_cuda else 256)
        torch.manual_seed(config.seed)
        with default_dtype(self.dtype), torch.device(self.device):
            self.model: CausalLM = build_model(
                cfg, self.tp, max(self.context_length, cfg.max_position)
            )
        self.model.eval()
        self.kv_scales = load_model_weights(
            self.model, config, self.resolved, self.hf_config, self.device, self.dtype
        )
        pack_model(self.model)  # CPU: weights reordered for oneDNN (see layers/cpu_linear.py)
        fusions = not config.disable_fused_silu_down, not config.disable_fused_norm_gemv
        set_batch1_fusions(self.model, *fusions)  # batch-1 GEMV prologues (models/decoder_layer)
        self.pool = self._make_pool()
        self._make_page_table(share)
        self.stager = DeviceStager(self.device)
        self.attn_backend = self._make_backend()
        self.sampler = Sampler(use_triton=on_cuda)
        rows = self.page_table.shape[0]
        self.penalties = PenaltyState(rows, cfg.vocab_size, self.device)
        # The token each table row sampled last: the next decode's input under overlap.
        self.last_tokens = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.graph_runner = self._make_graph_runner()
        if on_cuda:
            self._warm_up_sampler()

    # ---------------------------------------------------------------- setup
    def _join_device(self, device: torch.device) -> torch.device:
        if self.tp.size > 1:
            from minisgl.distributed.group import init_tp_group, rank_device

            # Each rank gets its own GPU (cuda:{local rank}); then join the groups: weight
            # loading needs none, but sizing the KV pool is a collective.
            device = rank_device(self.config, self.tp, device)
            init_tp_group(self.config, self.tp, device)
        elif device.type == "cuda" and device.index is None:
            device = torch.device("cuda", 0)
        return device

    def _make_pool(self) -> KVPool:
        cfg, c = self.model_config, self.config
        kv_heads = self.model.local_kv_heads
        # Never more than every request at full context could use.
        most = self.max_running_requests * self.context_length // c.page_size + 1
        pages = kv_pool_pages(c, cfg, kv_heads, self.device, self.dtype, self.kv_dtype, most)
        pages = agree_on_pages(pages, self.tp, self.device)
        per_page = KVPool.bytes_per_page(
            cfg.num_layers, c.page_size, kv_heads, cfg.head_dim, self.kv_dtype
        )
        gib, kind = pages * per_page / 2**30, str(self.kv_dtype).removeprefix("torch.")
        logger.info("KV pool: %d pages of %d tokens (%.2f GiB, %s)", pages, c.page_size, gib, kind)
        pool = KVPool(
            cfg.num_layers,
            pages + 1,
            c.page_size,
            kv_heads,
            cfg.head_dim,
            self.kv_dtype,
            self.device,
        )
        pool.num_pages = pages  # usable pages; the extra one is the scratch page
        if is_fp8(self.kv_dtype):  # a 16-bit cache keeps values as they are
            self.kv_scales.apply(pool.k_scales, pool.v_scales)
        return pool

    def _make_page_table(self, share: Engine | None) -> None:
        page_size = self.config.page_size
        # The context cannot exceed what the pool holds (minus one page of slack).
        self.context_length = min(self.context_length, (self.pool.num_pages - 1) * page_size)
        # The pool has one page more than the allocator hands out: padding rows of CUDA-graph
        # batches read and write it, and the spare page-table row points at it.
        self.scratch_slot = self.pool.num_pages * page_size
        if share is not None:
            self.context_length = share.context_length
            self.page_table: torch.Tensor = share.page_table
            return
        rows = self.max_running_requests + 1  # the extra row is scratch for padding
        width = self.context_length + page_size
        self.page_table = zeroed_page_table(rows, width, self.device)
        self.page_table[-1].fill_(self.scratch_slot)

    def _make_backend(self) -> AttentionBackend:
        # Fused only on CUDA: there the unfused layers run the same Triton kernels, so the
        # switch never changes outputs (on CPU they fall back to torch).
        fused = self.device.type == "cuda" and not self.config.disable_fused_rope_store
        fold = fused and not self.config.disable_fused_decode_rope  # into decode attention
        name = self.config.attention_backend
        return make_backend(name, self.pool, self.device, self.stager, fused, fold)

    @torch.inference_mode()
    def _warm_up_sampler(self) -> None:
        """Compile the sampler's kernels for every launch shape they take (greedy,
        temperature, top-k; few and many rows) before serving: a compile in the middle of a
        run stalls every request in flight."""
        hidden = torch.zeros(1, self.model_config.hidden_size, dtype=self.dtype, device=self.device)
        vocab = self.logits(hidden).shape[1]  # the LM head's width (TP may pad it)
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
        from minisgl.attention.triton_backend import TritonBackend  # triton: on CUDA only

        if not isinstance(self.attn_backend, TritonBackend):
            logger.warning("CUDA graphs need the triton attention backend; running eagerly")
            return None
        max_bs = c.cuda_graph_max_bs
        if max_bs is None:
            total = torch.cuda.get_device_properties(self.device).total_memory
            # 80 GB cards report 79.2 GiB: they take 256 as the H200 does (at 160, an
            # H100's offline decode batches of 161-256 rows ran eagerly, host-bound).
            max_bs = 256 if total > 60 * 2**30 else 160
        max_tokens = 2048 if c.cuda_graph_max_tokens is None else c.cuda_graph_max_tokens
        parts = (self.model, self.attn_backend, self.page_table, self.scratch_slot)
        target = GraphTarget(*parts, self.context_length, self.device, self.tp.size)
        return CudaGraphRunner(target, min(max_bs, self.max_running_requests), max_tokens)

    # ---------------------------------------------------------------- step
    def to_device(
        self, values: list[int] | torch.Tensor, dtype: torch.dtype = torch.long
    ) -> torch.Tensor:
        t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            # Pinned staging keeps the copy asynchronous, so the host never waits here.
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [R, vocab] (model dtype) of final hidden states [R, hidden]."""
        return self.model.logits(hidden)

    @torch.inference_mode()
    def forward(self, step: StepInput) -> PendingStep | None:
        """Launch one step: the model on every new token, then the samples of the sampling
        rows and the step's logits hooks; nothing here waits for the device. None when the
        step produces nothing (a prefill chunk that samples no token)."""
        layout, sample, fill = step.layout, step.sample, step.fill
        ends = np.cumsum(layout.extend_lens) - 1
        sample_rows = np.asarray(sample.rows if sample else [], dtype=np.int64)
        hook_index = [np.asarray(h.index, dtype=np.int64) for h in step.hooks]
        logits_index = np.concatenate([ends[sample_rows], *hook_index])
        prev_pos, prev_rows = zip(*step.from_previous) if step.from_previous else ((), ())
        # Every index this step needs travels in one pinned buffer and one copy.
        rows_and_steps = (sample.table_rows, sample.steps) if sample else ((), ())
        fills = (fill.positions, fill.sources) if fill else ((), ())
        table = (step.table.rows, step.table.cols, step.table.values) if step.table else ()
        segments: list[Segment] = [step.input_ids, step.positions, step.out_slots, logits_index]
        staged = self.stager.stage(
            [*segments, prev_pos, prev_rows, *rows_and_steps, *fills, *table], torch.long
        )
        ids, pos, slots, logits_idx, prev_pos_d, prev_rows_d, table_rows, steps = staged[:8]
        fill_pos_d, fill_src_d, *table_d = staged[8:]
        if table:  # the page table's new entries, before anything reads the table
            table_rows_d, table_cols_d, table_values_d = table_d
            self.page_table[table_rows_d, table_cols_d] = table_values_d
        if step.from_previous:
            ids[prev_pos_d] = self.last_tokens[prev_rows_d]
        if fill is not None and fill.positions:
            ids[fill_pos_d] = fill.values.view(-1)[fill_src_d]
        # A decode graph scores every row's last token, in order: nothing else.
        graph_ok = len(sample_rows) == len(layout.req_rows) and not step.hooks
        logits = self.run_model(layout, ids, pos, slots, logits_idx, graph_ok)
        hooks, at = [], len(sample_rows)
        for hook in step.hooks:
            hooks.append(hook.process(logits[at : at + len(hook.index)]))
            at += len(hook.index)
        out = None
        if sample is not None and len(sample_rows):
            out = self._sample(logits[: len(sample_rows)], sample, table_rows, steps)
        elif not hooks:
            return None
        return PendingStep(out, hooks)

    def _sample(
        self,
        logits: torch.Tensor,
        sample: SampleRequest,
        table_rows: torch.Tensor,
        steps: torch.Tensor,
    ) -> SampleOutput:
        if sample.allowed is not None:
            logits = apply_token_bitmask(logits, self.to_device(sample.allowed))
        penalties = self.penalties if sample.use_penalties else None
        slots = table_rows if sample.use_penalties else None
        out = self.sampler.sample(logits, sample.params.at(steps), penalties, slots)
        self.last_tokens[table_rows] = out.next_tokens
        if slots is not None:
            self.penalties.add_tokens(slots, out.next_tokens)
        return out

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
        whose tensors are on the device. ``graph_ok``: the logits wanted are every row's, in
        order, so a decode batch may replay a captured CUDA graph."""
        runner = self.graph_runner
        if runner is not None:
            self.pool.wait_all_layers()  # a graph cannot wait per layer for a tier's loads
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
