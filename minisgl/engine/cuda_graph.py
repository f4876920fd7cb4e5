"""CUDA graphs for decode batches and for small prefill/mixed batches.

Decode steps of a small model are bound by kernel launches, not by the GPU: one graph
replay replaces hundreds of launches. Graphs are captured for a list of batch sizes up to
``max_bs``; a batch is padded to the next captured size with dummy rows that read and
write a scratch page nobody owns. Sampling stays outside the graph (its work depends on
the requests' parameters), the LM head is inside.

Prefill and mixed prefill+decode steps of up to ``max_tokens`` new tokens replay graphs
too, captured per token count (padded to the next size): eagerly such a step costs tens of
milliseconds of Triton launches on the host for ~1 ms of GPU work, and every running
stream waits for it. Their attention metadata is padded to a fixed number of rows and query
tiles (see TritonBackend.prepare_extend_graph); they return the hidden states of the rows
to score, and the LM head runs after the replay, so each graph keeps only [rows, hidden].
"""

from __future__ import annotations

import gc
import logging
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from minisgl.attention.base import BatchLayout, ForwardBatch, padded_batch_size
from minisgl.models.decoder import CausalLM

if TYPE_CHECKING:  # triton is imported on CUDA only
    from minisgl.attention.triton_backend import TritonBackend, TritonMetadata
    from minisgl.attention.triton_plan import ExtendGraphShape

logger = logging.getLogger(__name__)


_live: weakref.WeakSet[CudaGraphRunner] = weakref.WeakSet()


def release_tp_graphs() -> None:
    """Free the captured graphs of this process's tensor-parallel engines (before leaving
    their group: tearing down NCCL while graphs that captured its collectives still exist
    hangs; PyTorch issue 115388). Those runners then run nothing; a TP=1 engine alive in
    the same process keeps its graphs."""
    for runner in list(_live):
        if runner.target.tp_size > 1:
            runner.release()


def graph_token_sizes(max_tokens: int) -> list[int]:
    """Token counts of the prefill/mixed graphs: powers of two and their midpoints."""
    sizes = [32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens}) if max_tokens > 0 else []


def graph_batch_sizes(max_bs: int) -> list[int]:
    """Every padded_batch_size up to max_bs's own (which may round max_bs up a little)."""
    return sorted({padded_batch_size(n) for n in range(1, max_bs + 1)})


@dataclass(frozen=True)
class GraphTarget:
    """What the graphs capture: the model and attention backend of one engine, the page
    table they read, and its scratch slot and context length."""

    model: CausalLM
    attn_backend: TritonBackend  # graphs need its launch shapes fixed by the padded size
    page_table: torch.Tensor
    scratch_slot: int
    context_length: int
    device: torch.device
    tp_size: int


class CudaGraphRunner:
    def __init__(self, engine: GraphTarget, max_bs: int, max_tokens: int = 0) -> None:
        self.engine = self.target = engine
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.token_sizes = graph_token_sizes(max_tokens)
        dev = engine.device
        self.dummy_row = engine.page_table.shape[0] - 1
        self.scratch_slot = engine.scratch_slot
        width = max([self.max_bs] + self.token_sizes)
        self.input_ids = torch.zeros(width, dtype=torch.long, device=dev)
        self.positions = torch.zeros(width, dtype=torch.long, device=dev)
        self.out_slots = torch.full((width,), self.scratch_slot, dtype=torch.long, device=dev)
        self.logits_index = torch.arange(self.max_bs, device=dev)
        # Prefill/mixed graphs score rows the caller picks: a buffer of their own.
        self.ext_logits_index = torch.zeros(self.max_bs, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.metadata: dict[int, TritonMetadata] = {}
        # Prefill/mixed graphs, by padded token count: row capacity, shape, graph, output.
        self.ext_rows = {t: min(t, self.max_bs) for t in self.token_sizes}
        # A row holds at most context_length tokens (its page-table row is that wide): a
        # graph is captured on as many full rows as its token count needs.
        self.row_tokens = engine.context_length
        self.token_sizes = [
            t for t in self.token_sizes if -(-t // self.row_tokens) <= self.ext_rows[t]
        ]
        self.ext_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.ext_outputs: dict[int, torch.Tensor] = {}
        self.ext_metadata: dict[int, TritonMetadata] = {}
        self.pool = torch.cuda.graph_pool_handle()  # the memory pool the graphs share
        self.replays = {"decode": 0, "extend": 0}  # for tests and logs
        self._capture_all()
        _live.add(self)

    def release(self) -> None:
        for graph in [*self.graphs.values(), *self.ext_graphs.values()]:
            graph.reset()
        self.graphs.clear()
        self.ext_graphs.clear()
        self.max_bs, self.token_sizes = 0, []  # can_run and can_run_extend: never
        torch.cuda.synchronize(self.engine.device)

    def _dummy_layout(self, bs: int) -> BatchLayout:
        return BatchLayout(
            req_rows=[self.dummy_row] * bs,
            prefix_lens=[0] * bs,
            extend_lens=[1] * bs,
            page_table=self.engine.page_table,
        )

    def _batch(self, tokens: int, metadata: object, logits_index: torch.Tensor) -> ForwardBatch:
        """The captured batch: the first ``tokens`` of the static input buffers."""
        return ForwardBatch(
            input_ids=self.input_ids[:tokens],
            positions=self.positions[:tokens],
            out_slots=self.out_slots[:tokens],
            attn_backend=self.engine.attn_backend,
            attn_metadata=metadata,
            logits_index=logits_index,
        )

    def _load_inputs(
        self, n: int, size: int, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Copy a batch's ``n`` tokens into the static buffers of a ``size``-token graph;
        padding tokens belong to no row: they write the scratch slot and are not scored."""
        self.input_ids[:n].copy_(ids, non_blocking=True)
        self.positions[:n].copy_(pos, non_blocking=True)
        self.out_slots[:n].copy_(slots, non_blocking=True)
        if n < size:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.out_slots[n:size].fill_(self.scratch_slot)

    def _capture_all(self) -> None:
        # No garbage collection mid-capture: freeing an earlier engine's pinned buffers there
        # may query CUDA events, which a capture forbids. (A GPU test's capture failed once,
        # cause unseen, with earlier engines awaiting collection; it passed when re-run.)
        gc.collect()
        gc.disable()
        try:
            self._capture_graphs()
        finally:
            gc.enable()

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        model = self.engine.model
        stream = torch.cuda.Stream(self.engine.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for tokens in reversed(self.token_sizes):  # largest first: the rest reuse its pool
                self._capture_extend(tokens, stream)
            for bs in reversed(self.sizes):
                md = self.engine.attn_backend.prepare(self._dummy_layout(bs), self.engine.device)
                batch = self._batch(bs, md, self.logits_index[:bs])
                model(batch)  # warm-up (Triton autotune/compile happens outside capture)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self.outputs[bs] = model(batch)
                self.graphs[bs] = graph
                self.metadata[bs] = md
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize(self.engine.device)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)
        if self.token_sizes:
            logger.info("captured CUDA graphs for prefill/mixed token counts %s", self.token_sizes)

    def _ext_shape(self, tokens: int) -> ExtendGraphShape:
        return self.engine.attn_backend.extend_graph_shape(tokens, self.ext_rows[tokens])

    def _capture_extend(self, tokens: int, stream: torch.cuda.Stream) -> None:
        # Captured on the scratch row, ``tokens`` new tokens in rows of at most a context
        # (a longer row would read past its page-table row): the padded shape, not the
        # layout, fixes every launch.
        lens = [self.row_tokens] * (tokens // self.row_tokens)
        if tokens % self.row_tokens:
            lens.append(tokens % self.row_tokens)
        layout = BatchLayout(
            [self.dummy_row] * len(lens), [0] * len(lens), lens, self.engine.page_table
        )
        backend = self.engine.attn_backend
        md = backend.prepare_extend_graph(layout, self.engine.device, self._ext_shape(tokens))
        batch = self._batch(tokens, md, self.ext_logits_index[: self.ext_rows[tokens]])
        body = self.engine.model.model  # the decoder stack, without the LM head
        body(batch)  # warm-up: compiles happen outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            self.ext_outputs[tokens] = body(batch)[batch.logits_index]
        self.ext_graphs[tokens] = graph
        self.ext_metadata[tokens] = md

    def can_run_extend(self, layout: BatchLayout, num_logits: int) -> bool:
        if not self.token_sizes or layout.is_decode:
            # A decode batch that cannot use a decode graph runs eagerly: an extend graph
            # would plan its rows as a mixed batch's (another split plan, other rounding).
            return False
        tokens = layout.num_tokens
        if tokens > self.token_sizes[-1]:
            return False
        size = next(s for s in self.token_sizes if s >= tokens)
        rows = self.ext_rows[size]
        return len(layout.req_rows) <= rows and num_logits <= rows

    def run_extend(
        self,
        layout: BatchLayout,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_slots: torch.Tensor,
        logits_index: torch.Tensor,
    ) -> torch.Tensor:
        """Logits at ``logits_index`` of a prefill/mixed batch, through its token-count graph."""
        n = layout.num_tokens
        size = next(s for s in self.token_sizes if s >= n)
        backend = self.engine.attn_backend
        backend.refresh(self.ext_metadata[size], layout, self.engine.device, self._ext_shape(size))
        self._load_inputs(n, size, input_ids, positions, out_slots)
        r = logits_index.shape[0]
        self.ext_logits_index[:r].copy_(logits_index, non_blocking=True)
        # Stale indices from a bigger graph's replay could point past this graph's tokens.
        self.ext_logits_index[r : self.ext_rows[size]].zero_()
        self.ext_graphs[size].replay()
        self.replays["extend"] += 1
        return self.engine.model.logits(self.ext_outputs[size][:r])

    def can_run(self, layout: BatchLayout) -> bool:
        return layout.is_decode and len(layout.req_rows) <= self.max_bs

    def run(
        self,
        layout: BatchLayout,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_slots: torch.Tensor,
    ) -> torch.Tensor:
        n = len(layout.req_rows)
        bs = next(s for s in self.sizes if s >= n)
        pad = bs - n
        padded = BatchLayout(
            req_rows=layout.req_rows + [self.dummy_row] * pad,
            prefix_lens=layout.prefix_lens + [0] * pad,
            extend_lens=layout.extend_lens + [1] * pad,
            page_table=layout.page_table,
        )
        self.engine.attn_backend.refresh(self.metadata[bs], padded, self.engine.device)
        self._load_inputs(n, bs, input_ids, positions, out_slots)
        self.graphs[bs].replay()
        self.replays["decode"] += 1
        return self.outputs[bs][:n]
