"""Prompt logprobs (vLLM's ``prompt_logprobs``): the logprob of every prompt token given the
tokens before it, and its top alternatives, scored while the prompt is prefilled.

A step collects, for the prompt chunks it computes, the flat positions whose logits predict
the next prompt token; a `LogitsHook` scores them on the device, and `store` appends the
values to each request once the step is read back. Such a request skips the prefix cache
(cached tokens have no logits to report: kv_manager.cached_prefix)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from minisgl.engine.step import LogitsHook
from minisgl.scheduler.request import Req


class PromptLogprobs:
    """The prompt positions one step scores."""

    def __init__(self) -> None:
        self.index: list[int] = []  # flat positions whose logits score the next prompt token
        self.targets: list[int] = []  # that next prompt token
        self.items: list[tuple[Req, int]] = []  # (request, how many of its positions)

    def add(self, req: Req, start: int, end: int, base: int) -> None:
        """The row of ``req`` computes tokens [start, end) at flat positions base + [start,
        end). Position p predicts prompt token p + 1; what was reported before a retraction
        is not scored again."""
        lo = max(start, len(req.prompt_logprobs))
        hi = min(end, len(req.prompt_ids) - 1)
        if hi > lo:
            self.index += range(base + lo, base + hi)
            self.targets += req.prompt_ids[lo + 1 : hi + 1]
            self.items.append((req, hi - lo))

    def hook(self, device: torch.device) -> LogitsHook | None:
        if not self.items:
            return None
        top_k = max(req.params.prompt_logprobs or 0 for req, _ in self.items)
        return LogitsHook(self.index, partial(_score, self.targets, top_k, device))

    def store(self, results: list[Any]) -> None:
        """The hook's results: chosen logprobs [n], and top ids / logprobs [n, k] or None."""
        chosen, top_ids, top_lps = results
        i = 0
        for req, n in self.items:
            k = req.params.prompt_logprobs or 0
            req.prompt_logprobs += chosen[i : i + n]
            if k and top_ids is not None and top_lps is not None:
                for ids, lps in zip(top_ids[i : i + n], top_lps[i : i + n]):
                    req.prompt_top_logprobs.append(list(zip(ids[:k], lps[:k])))
            i += n


def _score(
    targets: list[int], top_k: int, device: torch.device, logits: torch.Tensor
) -> list[torch.Tensor | None]:
    logp = torch.log_softmax(logits.float(), dim=-1)
    want = torch.tensor(targets, dtype=torch.long).to(device, non_blocking=True)
    chosen = logp.gather(1, want[:, None])[:, 0]
    if top_k:
        top = logp.topk(top_k, dim=-1)
        return [chosen, top.indices, top.values]
    return [chosen, None, None]
