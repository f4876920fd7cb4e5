"""Vocab-parallel embedding and LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import TPInfo, all_gather_last_dim, all_reduce
from minisgl.kernels import GemvTiles
from minisgl.layers.cpu_linear import linear
from minisgl.layers.quantization import EmbeddingQuantMethod


def _pad(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary; missing rows are summed in."""

    weight: nn.Parameter  # float weights, and quantized ones once made float

    def __init__(
        self, vocab_size: int, hidden: int, tp: TPInfo, quant: EmbeddingQuantMethod | None = None
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.local_vocab = _pad(vocab_size, tp.size) // tp.size
        self.start = tp.rank * self.local_vocab
        self.quant = quant
        if quant is not None:
            quant.create_weights(self, self.local_vocab, hidden, hidden, self.load_shard)
            return
        self.weight = nn.Parameter(torch.zeros(self.local_vocab, hidden), requires_grad=False)
        self.weight.weight_loader = self.load_shard  # type: ignore[attr-defined]

    def finish_loading(self, dtype: torch.dtype) -> None:
        """Called once the checkpoint is loaded (models/loader.py)."""
        if self.quant is not None and not self.quant.finish_loading(self, dtype):
            self.quant = None

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.embed(self, ids.flatten()).view(*ids.shape, -1)
        return F.embedding(ids, self.weight)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        n = min(self.local_vocab, max(0, self.vocab_size - self.start))
        param.data[:n].copy_(loaded.narrow(0, self.start, n))

    def forward(self, ids: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """``reduce=False``: this rank's rows only (zeros elsewhere), to be summed by the caller."""
        if self.tp.size == 1:
            return self._lookup(ids)
        local = ids - self.start
        mask = (local < 0) | (local >= self.local_vocab)
        out = self._lookup(local.masked_fill(mask, 0))
        out.masked_fill_(mask.unsqueeze(-1), 0)
        return all_reduce(out, self.tp) if reduce else out


class ParallelLMHead(VocabParallelEmbedding):
    """Vocab-sharded output projection; logits are gathered to the full vocabulary. A model
    with tied embeddings uses one module for both (models/decoder.py)."""

    cpu_packed: torch.Tensor | None = None  # see layers/cpu_linear.py

    gemv_tiles: GemvTiles | None = None  # CUDA batch-1 GEMV (set by pack_model)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            logits = self.quant.apply(self, hidden, None)
        else:
            logits = linear(hidden, self.weight, None, self.cpu_packed, self.gemv_tiles)
        logits = all_gather_last_dim(logits, self.tp)
        return logits[..., : self.vocab_size]
