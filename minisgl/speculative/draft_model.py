"""Draft-model speculation: a small model with the target's vocabulary proposes K tokens
per request by K batched autoregressive forwards; the target verifies them in one forward.

KV layout: the draft engine shares the target's page table and has a pool of the same page
count, so a token's draft K/V sits at the same slot index as its target K/V. Allocation,
the radix cache, retraction and rollback are therefore the target's alone: pages are freed
once for both. ``req.draft_len`` counts the leading tokens whose draft K/V is written; only
tokens below it may enter the prefix cache (see KVManager.cache_prefix), so a cache hit
brings valid draft K/V along. Draft K/V past draft_len (rejected drafts) is overwritten.

Per step (overlap scheduling is off while speculating, so every token is known on the host):
  1. one extend forward over the prefill chunks of the batch (the draft sees every prompt
     token the target sees) and, for each speculating row, the tokens from draft_len up to
     its last known token (usually the bonus token, or the last draft and the bonus);
     the logits at that last token give draft 1;
  2. K - 1 decode forwards feed draft j and sample draft j + 1 (CUDA graphs apply);
  3. after verification, draft_len covers the kept drafts that were fed (all but the last).
Draft tokens and the draft's distributions q stay on the device; the target reads them there.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from minisgl.attention.base import BatchLayout
from minisgl.config import EngineConfig
from minisgl.engine.engine import Engine, _default_dtype, read_hf_config
from minisgl.engine.sampler import _i64, race
from minisgl.kvcache.pool import KVPool
from minisgl.models.config import ModelConfig
from minisgl.models.resolve import resolve_model_path
from minisgl.scheduler.kv_manager import ranges
from minisgl.scheduler.request import Req
from minisgl.speculative.speculator import BatchRow, Proposal, Speculator

# Draft sampling noise must be independent of the verifier's (same seed, same positions).
_DRAFT_SALT = _i64(0xD1B54A32D192ED03)


def _draft_model_config(config: EngineConfig) -> ModelConfig:
    assert config.speculative_draft_model is not None
    resolved = resolve_model_path(config.speculative_draft_model)
    return ModelConfig.from_dict(read_hf_config(resolved))


def draft_footprint(
    config: EngineConfig, dtype: torch.dtype, kv_dtype: torch.dtype
) -> tuple[int, int]:
    """(weight bytes, KV bytes per page) of the draft model, before it is loaded: the
    target's pool is sized to leave room for both. Weights are in ``dtype``, the draft's
    pool in ``kv_dtype`` (the same --kv-cache-dtype as the target's)."""
    from minisgl.distributed import TPInfo
    from minisgl.models.registry import build_model

    cfg = _draft_model_config(config)
    with _default_dtype(dtype), torch.device("meta"):
        model = build_model(cfg, TPInfo(), cfg.max_position)
    elem = torch.empty((), dtype=dtype).element_size()
    weights = sum(p.numel() for p in model.parameters()) * elem
    page = KVPool.bytes_per_page(
        cfg.num_layers, config.page_size, cfg.num_kv_heads, cfg.head_dim, kv_dtype
    )
    return weights, page


def make_draft_engine(target: Engine) -> Engine:
    c = target.config
    draft_cfg = _draft_model_config(c)
    vocab = target.model_config.vocab_size
    if draft_cfg.vocab_size != vocab:
        raise ValueError(
            f"speculative_draft_model={c.speculative_draft_model!r} has a vocabulary of "
            f"{draft_cfg.vocab_size} tokens, the target {vocab}: the draft model must share "
            "the target's tokenizer and vocabulary"
        )
    config = replace(
        c,
        model=c.speculative_draft_model,
        tokenizer=None,
        load_format="dummy" if c.load_format == "dummy" else "auto",
        speculative_algorithm=None,
        speculative_draft_model=None,
        num_pages=target.pool.num_pages,
        context_length=target.context_length,
    )
    return Engine(config, target.tp, share=target)


class DraftModelSpeculator(Speculator):
    def __init__(self, engine: Engine, k: int, host_table: torch.Tensor) -> None:
        super().__init__(engine, k)
        self.draft = make_draft_engine(engine)
        self.host_table = host_table  # the scheduler's host copy of the shared page table
        self.vocab = engine.model_config.vocab_size

    def plan(self, req: Req) -> int:
        return self.budget(req)  # a draft model always proposes the full budget

    def verified(self, req: Req, accepted: int) -> None:
        # Drafts 1..n-1 were fed to the draft model (draft n never is): the kept ones among
        # them now have valid draft K/V.
        req.draft_len = min(req.draft_len + min(accepted, req.num_draft - 1), req.kv_len)

    @torch.inference_mode()
    def propose(self, rows: list[BatchRow]) -> Proposal | None:
        spec = [r.req for r in rows if r.spec]
        # Longest drafts first: the rows still drafting at step j are then a prefix.
        order = sorted(range(len(spec)), key=lambda i: -spec[i].num_draft)
        feed = [(r.req, r.req.kv_len + r.extend) for r in rows if _is_prefill(r)]
        feed += [(spec[i], spec[i].num_known) for i in order]
        if not feed:
            return None
        first = self._extend(feed, len(feed) - len(spec))
        if not spec:
            return None
        return self._draft([spec[i] for i in order], first, order)

    def _extend(self, feed: list[tuple[Req, int]], n_prefill: int) -> torch.Tensor:
        """Feed each request its tokens [draft_len, end); logits at the last token of the
        rows after the first ``n_prefill`` (the speculating ones)."""
        starts = [q.draft_len for q, _ in feed]
        lens = [end - s for (_, end), s in zip(feed, starts)]
        req_rows = [q.row for q, _ in feed]
        row_idx, positions = ranges(req_rows, starts, lens)
        ids: list[int] = []
        for (q, end), s in zip(feed, starts):
            ids += q.token_slice(s, end)
            q.draft_len = end
        ends = torch.tensor(lens).cumsum(0) - 1
        layout = BatchLayout(req_rows, starts, lens, self.engine.page_table)
        # The engine's stager: one copy, 16-byte-aligned segments (no Triton re-specialising).
        ids_d, pos_d, slots_d, ends_d = self.draft.stager.stage(
            [ids, positions, self.host_table[row_idx, positions], ends], torch.long
        )
        return self.draft.run_model(layout, ids_d, pos_d, slots_d, ends_d[n_prefill:], False)

    def _draft(self, reqs: list[Req], logits: torch.Tensor, order: list[int]) -> Proposal:
        """Sample draft 1 from the extend's logits, then K - 1 decode forwards; rows come
        back in the scheduler's order."""
        s, k, dev = len(reqs), self.k, self.draft.device
        active = [sum(q.num_draft > j for q in reqs) for j in range(k)]  # non-increasing
        last = [q.num_known - 1 for q in reqs]  # position of each row's last known token
        # Every index of the K - 1 decode steps (positions, then slots) in one copy.
        pos = [
            torch.tensor([p + j for p in last[: active[j]]], dtype=torch.long) for j in range(1, k)
        ]
        slots = [self.host_table[[q.row for q in reqs[: len(p)]], p] for p in pos]
        parts = self.draft.stager.stage([*pos, *slots], torch.long)
        sampler = _DraftSampler(reqs, k, self.vocab, self.draft)
        drafts = torch.full((s, k), -1, dtype=torch.long, device=dev)
        for j in range(k):
            m = active[j]
            if m == 0:
                break
            if j > 0:
                layout = BatchLayout(
                    [q.row for q in reqs[:m]],
                    [p + j for p in last[:m]],
                    [1] * m,
                    self.engine.page_table,
                )
                ids = drafts[:m, j - 1]
                all_rows = torch.arange(m, device=dev)
                pos_d, slots_d = parts[j - 1], parts[k - 1 + j - 1]
                logits = self.draft.run_model(layout, ids, pos_d, slots_d, all_rows, True)
            drafts[:m, j] = sampler.sample(logits[:m], j)
        inv = torch.empty(s, dtype=torch.long)
        inv[torch.tensor(order)] = torch.arange(s)
        inv_d = self.draft.to_device(inv)
        probs = sampler.probs[inv_d] if sampler.probs is not None else None
        return Proposal(drafts[inv_d], probs)


class _DraftSampler:
    """Samples each draft from the draft model's distribution at the request's temperature
    (argmax for greedy rows) and records that distribution q for verification; all-greedy
    batches record nothing, as their q is one-hot (a deterministic draft)."""

    def __init__(self, reqs: list[Req], k: int, vocab: int, engine: Engine) -> None:
        greedy = [q.params.is_greedy for q in reqs]
        self.probs: torch.Tensor | None = None
        if all(greedy):
            return
        dev = engine.device
        self.vocab = vocab
        self.ids = torch.arange(vocab, device=dev)
        temps = [0.0 if g else q.params.temperature for q, g in zip(reqs, greedy)]
        temps_d = engine.to_device(torch.tensor(temps, dtype=torch.float32))
        self.greedy = temps_d == 0
        self.temps = torch.where(self.greedy, torch.ones_like(temps_d), temps_d)
        ints = [_i64(q.seed) ^ _DRAFT_SALT for q in reqs] + [q.num_generated for q in reqs]
        self.seeds, self.steps = engine.to_device(ints).split(len(reqs))
        self.probs = torch.zeros(len(reqs), k, vocab, device=dev)

    def sample(self, logits: torch.Tensor, j: int) -> torch.Tensor:
        if self.probs is None:
            return logits.argmax(dim=-1)  # the same in the model's dtype: no float32 copy
        x = logits.float()  # logits come in the model's dtype; the upcast is exact
        m = len(x)
        scaled = x / self.temps[:m, None]
        tok = race(scaled, self.seeds[:m], self.steps[:m] + j, self.ids)
        tok = torch.where(self.greedy[:m], x.argmax(dim=-1), tok)
        q = torch.softmax(scaled, dim=-1)
        one_hot = torch.nn.functional.one_hot(tok, self.vocab).to(q.dtype)
        self.probs[:m, j] = torch.where(self.greedy[:m, None], one_hot, q)
        return tok


def _is_prefill(row: BatchRow) -> bool:
    """Rows whose tokens the draft model must see too: prompt chunks and the recomputation
    of a retracted request. Plain decodes of requests that never speculate are skipped."""
    return not row.spec and (row.extend > 1 or row.req.num_generated == 0)
