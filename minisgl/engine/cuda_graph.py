"""CUDA graphs for decode batches.

Decode steps of a small model are bound by kernel launches, not by the GPU: one graph
replay replaces hundreds of launches. Graphs are captured for a list of batch sizes up to
``max_bs``; a batch is padded to the next captured size with dummy rows that read and
write a scratch page nobody owns. Sampling stays outside the graph (its work depends on
the requests' parameters), the LM head is inside.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from minisgl.attention.base import BatchLayout
from minisgl.engine.batch import ForwardBatch

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, every 16 beyond: small padding waste where it counts."""
    sizes = [1, 2, 4, 8] + list(range(16, 65, 8)) + list(range(80, max_bs + 1, 16))
    sizes = sorted({s for s in sizes if s <= max_bs} | {max_bs})
    return sizes


class CudaGraphRunner:
    def __init__(self, engine: Engine, max_bs: int) -> None:
        self.engine = engine
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        dev = engine.device
        self.dummy_row = engine.page_table.shape[0] - 1
        self.scratch_slot = engine.scratch_slot
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.long, device=dev)
        self.positions = torch.zeros(self.max_bs, dtype=torch.long, device=dev)
        self.out_slots = torch.full((self.max_bs,), self.scratch_slot, dtype=torch.long, device=dev)
        self.logits_index = torch.arange(self.max_bs, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.metadata: dict[int, object] = {}
        self.pool: Any = None  # the memory pool handle the graphs share
        self._capture_all()

    def _dummy_layout(self, bs: int) -> BatchLayout:
        return BatchLayout(
            req_rows=[self.dummy_row] * bs,
            prefix_lens=[0] * bs,
            extend_lens=[1] * bs,
            page_table=self.engine.page_table,
        )

    def _batch(self, bs: int, metadata: object) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_slots=self.out_slots[:bs],
            attn_backend=self.engine.attn_backend,
            attn_metadata=metadata,
            logits_index=self.logits_index[:bs],
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        model = self.engine.model
        stream = torch.cuda.Stream(self.engine.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its pool
                md = self.engine.attn_backend.prepare(self._dummy_layout(bs), self.engine.device)
                batch = self._batch(bs, md)
                model(batch)  # warm-up (Triton autotune/compile happens outside capture)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self.outputs[bs] = model(batch)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[bs] = graph
                self.metadata[bs] = md
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize(self.engine.device)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

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
        fresh = self.engine.attn_backend.prepare(padded, self.engine.device)
        self.engine.attn_backend.copy_metadata(self.metadata[bs], fresh)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.out_slots[:n].copy_(out_slots, non_blocking=True)
        if pad:
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.out_slots[n:bs].fill_(self.scratch_slot)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
