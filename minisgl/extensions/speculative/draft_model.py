"""Draft-model speculation: a small model with the target's vocabulary proposes K tokens
per request by K batched autoregressive forwards; the target verifies them in one forward.

KV layout: the draft engine shares the target's page table and has a pool of the same page
count, so a token's draft K/V sits at the same slot index as its target K/V. Allocation,
the radix cache, retraction and rollback are therefore the target's alone: pages are freed
once for both. A request's ``draft_len`` counts the leading tokens whose draft K/V is written; only
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

import dataclasses
from dataclasses import dataclass

import torch

from minisgl.attention.base import BatchLayout
from minisgl.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.engine.noise import i64, race
from minisgl.engine.setup import default_dtype, read_hf_config
from minisgl.extensions.speculative.options import SpeculativeOptions, without_speculation
from minisgl.extensions.speculative.speculator import Proposal, SpeculatorBase
from minisgl.kvcache.pool import KVPool
from minisgl.models.config import ModelConfig
from minisgl.models.resolve import resolve_model_path
from minisgl.scheduler.kv_manager import KVManager, ranges
from minisgl.scheduler.request import Req, Row

# Draft sampling noise must be independent of the verifier's (same seed, same positions).
_DRAFT_SALT = i64(0xD1B54A32D192ED03)


def _draft_model_config(path: str) -> ModelConfig:
    return ModelConfig.from_dict(read_hf_config(resolve_model_path(path)))


def draft_footprint(
    config: EngineConfig, dtype: torch.dtype, kv_dtype: torch.dtype
) -> tuple[int, int]:
    """(weight bytes, KV bytes per page) of the draft model, before it is loaded: the
    target's pool is sized to leave room for both (0, 0 without one). Weights are in
    ``dtype``, the draft's pool in ``kv_dtype`` (the same --kv-cache-dtype as the target's)."""
    from minisgl.distributed import TPInfo
    from minisgl.models.registry import build_model

    path = config.ext(SpeculativeOptions).speculative_draft_model
    if path is None:
        return 0, 0
    cfg = _draft_model_config(path)
    with default_dtype(dtype), torch.device("meta"):
        model = build_model(cfg, TPInfo(), cfg.max_position)
    elem = torch.empty((), dtype=dtype).element_size()
    weights = sum(p.numel() for p in model.parameters()) * elem
    page = KVPool.bytes_per_page(
        cfg.num_layers, config.page_size, cfg.num_kv_heads, cfg.head_dim, kv_dtype
    )
    return weights, page


def make_draft_engine(target: Engine) -> Engine:
    c = target.config
    path = c.ext(SpeculativeOptions).speculative_draft_model
    assert path is not None
    draft_cfg = _draft_model_config(path)
    vocab = target.model_config.vocab_size
    if draft_cfg.vocab_size != vocab:
        raise ValueError(
            f"speculative_draft_model={path!r} has a vocabulary of "
            f"{draft_cfg.vocab_size} tokens, the target {vocab}: the draft model must share "
            "the target's tokenizer and vocabulary"
        )
    config = dataclasses.replace(
        without_speculation(c),
        model=path,
        tokenizer=None,
        load_format="dummy" if c.load_format == "dummy" else "auto",
        num_pages=target.pool.num_pages,
        context_length=target.context_length,
    )
    return Engine(config, target.tp, share=target)


@dataclass
class _DraftState:
    admit_order: int  # the admission it belongs to: a readmitted request starts afresh
    draft_len: int  # leading tokens whose draft-model K/V is in the draft pool


class DraftModelSpeculator(SpeculatorBase):
    def __init__(self, engine: Engine, kv: KVManager) -> None:
        if kv.tier is not None:
            # A second KV tier (HiCache) saves and loads the target's pool only: a prefix
            # loaded back would have no draft K/V.
            raise ValueError(
                "speculative_draft_model is invalid with a host KV tier (hicache_size > 0): "
                "use speculative_algorithm ngram"
            )
        super().__init__(engine)
        self.draft = make_draft_engine(engine)
        self.host_table = kv.host_table  # the scheduler's host copy of the shared page table
        self.vocab = engine.model_config.vocab_size
        self.states: dict[int, _DraftState] = {}  # by request uid

    def _state(self, req: Req) -> _DraftState:
        """At (re)admission the request's cached prefix has draft K/V too: only tokens with
        both may enter the prefix cache (`cacheable`)."""
        state = self.states.get(req.uid)
        if state is None or state.admit_order != req.admit_order:
            state = self.states[req.uid] = _DraftState(req.admit_order, req.kv_len)
        return state

    def plan(self, req: Req) -> int:
        return self.budget(req)  # a draft model always proposes the full budget

    def verified(self, row: Row, accepted: int) -> None:
        # Drafts 1..n-1 were fed to the draft model (draft n never is): the kept ones among
        # them now have valid draft K/V (never past what the target keeps of the row).
        state = self._state(row.req)
        kept = row.req.kv_len - row.drafts + accepted
        state.draft_len = min(state.draft_len + min(accepted, row.drafts - 1), kept)

    def cacheable(self, req: Req) -> int:
        return min(req.kv_len, self._state(req).draft_len)

    def release(self, req: Req) -> None:
        self.states.pop(req.uid, None)

    def check_integrity(self, live: list[Req]) -> None:
        for r in live:
            state = self.states.get(r.uid)
            if r.row < 0 or state is None or state.admit_order != r.admit_order:
                continue
            assert r.tree_len <= state.draft_len <= r.kv_len, (
                f"draft K/V of request {r.uid} out of step: tree {r.tree_len}, "
                f"draft {state.draft_len}, target {r.kv_len}"
            )

    @torch.inference_mode()
    def propose(self, rows: list[Row], verify: list[Row]) -> Proposal | None:
        # Longest drafts first: the rows still drafting at step j are then a prefix.
        order = sorted(range(len(verify)), key=lambda i: -verify[i].drafts)
        feed = [(r.req, r.req.kv_len + r.extend) for r in rows if _is_prefill(r)]
        feed += [(verify[i].req, verify[i].req.num_known) for i in order]
        if not feed:
            return None
        first = self._extend(feed, len(feed) - len(verify))
        if not verify:
            return None
        return self._draft([verify[i] for i in order], first, order)

    def _extend(self, feed: list[tuple[Req, int]], n_prefill: int) -> torch.Tensor:
        """Feed each request its tokens [draft_len, end); logits at the last token of the
        rows after the first ``n_prefill`` (the speculating ones)."""
        states = [self._state(q) for q, _ in feed]
        starts = [st.draft_len for st in states]
        lens = [end - s for (_, end), s in zip(feed, starts)]
        req_rows = [q.row for q, _ in feed]
        row_idx, positions = ranges(req_rows, starts, lens)
        ids: list[int] = []
        for (q, end), s, st in zip(feed, starts, states):
            ids += q.token_slice(s, end)
            st.draft_len = end
        ends = torch.tensor(lens).cumsum(0) - 1
        layout = BatchLayout(req_rows, starts, lens, self.engine.page_table)
        # The engine's stager: one copy, 16-byte-aligned segments (no Triton re-specialising).
        ids_d, pos_d, slots_d, ends_d = self.draft.stager.stage(
            [ids, positions, self.host_table[row_idx, positions], ends], torch.long
        )
        return self.draft.run_model(layout, ids_d, pos_d, slots_d, ends_d[n_prefill:], False)

    def _draft(self, rows: list[Row], logits: torch.Tensor, order: list[int]) -> Proposal:
        """Sample draft 1 from the extend's logits, then K - 1 decode forwards; rows come
        back in the scheduler's order."""
        reqs = [r.req for r in rows]
        s, k, dev = len(reqs), self.k, self.draft.device
        active = [sum(r.drafts > j for r in rows) for j in range(k)]  # non-increasing
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
        ints = [i64(q.seed) ^ _DRAFT_SALT for q in reqs] + [q.num_generated for q in reqs]
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


def _is_prefill(row: Row) -> bool:
    """Rows whose tokens the draft model must see too: prompt chunks and the recomputation
    of a retracted request. Plain decodes of requests that never speculate are skipped."""
    return not row.drafts and (row.extend > 1 or row.req.num_generated == 0)
