"""The scheduler: continuous batching with chunked prefill, mixed batches, preemption.

Each ``step`` builds one batch (running decodes plus prefill chunks within a token budget),
runs it through the engine, and turns sampled tokens into request progress.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from minisgl.attention.base import BatchLayout
from minisgl.engine.engine import (
    Engine,
    HostSamples,
    PromptLogprobRequest,
    SampleResult,
    SpecRequest,
)
from minisgl.engine.sampler import SamplingRows
from minisgl.sampling_params import SamplingParams
from minisgl.scheduler.grammar import GrammarBackend
from minisgl.scheduler.kv_manager import KVManager, ranges
from minisgl.scheduler.policy import check_priority
from minisgl.scheduler.request import Req, ReqState
from minisgl.scheduler.stop import StopChecker, tokenizer_of
from minisgl.speculative.speculator import BatchRow, Proposal, make_speculator

logger = logging.getLogger(__name__)

LPM_MAX_QUEUE = 128  # beyond this many waiting requests, LPM sorting costs more than it saves
IN_BATCH_PREFIX_MIN = 32  # defer a request that shares this many uncached tokens with one admitted


@dataclass
class _Row:
    req: Req
    extend: int
    samples: bool
    spec: bool = False  # a decode row carrying draft tokens to verify


@dataclass
class _InFlight:
    reqs: list[Req]  # the rows that sample, in row order
    output: SampleResult | None
    prompt_lp_reqs: list[tuple[Req, int]]  # (request, how many prompt logprobs it gets)
    spec_reqs: list[Req] = field(default_factory=list)  # rows verifying drafts, in row order
    constrained: bool = False  # a sampling row has a grammar: read back before the next launch


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        decode: Callable[[list[int]], str] | None = None,
        overlap: bool | None = None,
    ) -> None:
        self.engine = engine
        cfg = engine.config
        # Overlap pays off only when the device runs asynchronously; on CPU it can be forced
        # (tests do, to check the one-step-late bookkeeping).
        if overlap is None:
            overlap = overlap_default(engine.device.type, cfg.disable_overlap_scheduling)
        # Speculation reads each step's result before drafting the next: no overlap.
        self.spec_k = cfg.speculative_num_steps if cfg.speculative_algorithm else 0
        self.overlap = overlap and not self.spec_k
        self.inflight: _InFlight | None = None
        self.config = cfg
        self.page_size = cfg.page_size
        self.kv = KVManager(
            engine.page_table,
            engine.pool.num_pages,
            cfg.page_size,
            engine.max_running_requests,
            cfg.cache,
            engine.stager,
            draft_kv=cfg.speculative_algorithm == "draft",
        )
        self.spec = make_speculator(engine, self.kv.host_table)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.stop_checker = StopChecker(engine.model_config.eos_token_ids, decode)
        self.grammar = GrammarBackend(
            lambda: tokenizer_of(decode),
            engine.model_config.vocab_size,
            engine.model_config.eos_token_ids,
        )
        self.rng = random.Random(cfg.seed)
        self.uids = itertools.count()
        self.admit_counter = itertools.count()
        self.arrivals = itertools.count()
        # --schedule-policy priority: the waiting queue is kept in (priority, arrival) order,
        # and a step whose admission was blocked lets the next one preempt for the queue's head.
        self.by_priority = cfg.schedule_policy == "priority"
        self._admission_blocked = False
        self.new_token_ratio = cfg.init_new_token_ratio
        self.ratio_decay = (cfg.init_new_token_ratio - cfg.min_new_token_ratio) / 600
        self.context_length = engine.context_length
        self.prefill_tokens = 0  # tokens computed in prefill (for prefix-cache savings)
        # Where host time goes: benchmarks print these to tell CPU- from GPU-bound runs.
        self.stats = {
            "steps": 0,
            "decode_steps": 0,
            "launch_s": 0.0,
            "wait_s": 0.0,
            "process_s": 0.0,
            # speculation: verifying rows, draft tokens verified, draft tokens accepted
            "spec_rows": 0,
            "spec_drafted": 0,
            "spec_accepted": 0,
        }
        self.num_retractions = 0
        self.num_priority_preemptions = 0  # retractions to admit a higher-priority request
        # The last step's sampling rows, reused while the same requests sample.
        self._sampling: SamplingRows | None = None
        self._sampling_key: tuple[tuple[int, ...], bool] = ((), False)

    # ------------------------------------------------------------ requests
    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """ValueError naming the problem if the prompt can never be served."""
        if len(prompt_ids) == 0:
            raise ValueError("prompt is empty: at least one token is required")
        if len(prompt_ids) >= self.context_length:
            raise ValueError(
                f"prompt is {len(prompt_ids)} tokens, but the context length is "
                f"{self.context_length}: prompt too long"
            )
        vocab = self.engine.model_config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")

    def check_request(
        self, prompt_ids: Sequence[int], params: SamplingParams, priority: object = 0
    ) -> None:
        """ValueError naming the problem if this request can never be served: its prompt, its
        priority under this scheduler's policy, or a constraint that does not compile."""
        self.check_prompt(prompt_ids)
        self.check_priority(priority)
        self.grammar_matcher(params)  # compiled grammars are cached: adding it costs nothing

    def check_priority(self, priority: object) -> int:
        """ValueError naming ``priority`` if this scheduler cannot honour it."""
        return check_priority(priority, self.config.schedule_policy)

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        uid: int | None = None,
        priority: int = 0,
    ) -> Req:
        self.check_prompt(prompt_ids)
        self.check_priority(priority)
        matcher = self.grammar_matcher(params)
        wait = self.grammar.wait_for(params.grammar_after, prompt_ids)  # () without a grammar
        seed = params.seed if params.seed is not None else self.rng.getrandbits(62)
        req = Req(
            uid=next(self.uids) if uid is None else uid,
            prompt_ids=list(prompt_ids),
            params=params,
            seed=seed,
            grammar=matcher,
            grammar_wait=wait,
            priority=priority,
            arrival=next(self.arrivals),
        )
        self._enqueue(req, retracted=False)
        return req

    def _enqueue(self, req: Req, retracted: bool) -> None:
        """Queue a new or retracted request. FCFS/LPM: new ones at the back, retracted ones at
        the front (they were admitted before anything still waiting). Priority: at their
        (priority, arrival) place, found by bisection (the queue is kept sorted, so no step
        sorts it)."""
        if self.by_priority:
            bisect.insort(self.waiting, req, key=_priority_key)
        elif retracted:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def grammar_matcher(self, params: SamplingParams) -> object | None:
        """A matcher for the request's structured-output constraint (None without one);
        ValueError if it cannot be served."""
        grammar = params.grammar
        if grammar is None:
            return None
        if self.spec_k:
            raise ValueError(f"{grammar[0]} is not supported with speculative decoding")
        matcher = self.grammar.matcher(*grammar)
        if params.grammar_after is not None:
            self.grammar.marker(params.grammar_after)
        return matcher

    def abort(self, uid: int) -> Req | None:
        for req in self.waiting:
            if req.uid == uid:
                self.waiting.remove(req)
                self._finish(req, "abort")
                return req
        for req in self.running:
            if req.uid == uid:
                self.running.remove(req)
                self._finish(req, "abort")
                self.kv.release(req)
                return req
        return None

    def drain(self) -> list[Req]:
        """Read back the batch still in flight (overlap mode), e.g. before going idle."""
        batch, self.inflight = self.inflight, None
        return self._process(batch) if batch is not None else []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.inflight)

    # ------------------------------------------------------------ step
    def step(self) -> list[Req]:
        """Run one batch; returns the requests that got a token or finished.

        With overlap scheduling the next batch is launched before the previous one's
        samples are read back, so the CPU prepares step N+1 while the device runs step N.
        """
        prev, self.inflight = self.inflight, None
        # A constrained row's next bitmask needs the token it just sampled.
        if prev is not None and (not self.overlap or prev.constrained):
            done = self._process(prev)
            prev = None
        else:
            done = []
        t0 = time.perf_counter()
        rows = self._schedule(busy=prev is not None)
        if rows:
            self.inflight = self._launch(rows)
            self.stats["steps"] += 1
            self.stats["decode_steps"] += all(r.extend == 1 for r in rows)
        self.stats["launch_s"] += time.perf_counter() - t0
        if prev is not None:
            done = self._process(prev)
        if not self.overlap and self.inflight is not None:
            done += self._process(self.inflight)
            self.inflight = None
        return done

    def _schedule(self, busy: bool = False) -> list[_Row]:
        """The next batch's rows. ``busy``: a batch is still in flight (overlap), so its
        results may yet finish requests and free their pages."""
        if self._admission_blocked:
            self._admission_blocked = False
            self._preempt_for_priority()
        mixed = not self.config.disable_mixed_batch
        decodes, partial = self._split_running()
        rows: list[_Row] = []
        if mixed or not (partial or self.waiting):
            rows = self._schedule_decodes(decodes)
        # Decode rows count against the step's token budget (a step's length is its
        # latency for every stream), but prefill always keeps a quarter of it: with as many
        # decodes as the budget, a chunked prompt would otherwise wait for one to finish.
        chunk = self.engine.chunked_prefill_size
        budget = max(chunk - len(rows), chunk // 4)
        if mixed or not rows:
            rows += self._schedule_prefill(partial, budget)
        if not rows and decodes and not mixed:
            rows = self._schedule_decodes(decodes)
        if not rows and self.running and not busy:
            # Nothing could get memory: give the newest (or, by priority, the least important)
            # request's pages back and retry later. Not while a batch is in flight: then the
            # running requests may only be waiting for their last token (nothing to schedule
            # is no shortage), and if pages are short, the next step, with nothing in flight,
            # still retracts.
            self._retract(max(self.running, key=self._victim_key))
        return rows

    def _split_running(self) -> tuple[list[Req], list[Req]]:
        """Running requests that decode next (by uid, so every TP rank orders them alike)
        and those with prompt tokens still to prefill. A request whose in-flight token is
        its last needs no further step. One pass with the properties inlined: this runs
        over every running request on every step."""
        decodes: list[Req] = []
        partial: list[Req] = []
        ctx = self.context_length
        for r in self.running:
            n_out = len(r.output_ids) + r.inflight
            n_tok = len(r.prompt_ids) + n_out
            pending = n_tok - r.kv_len
            if pending == 1:
                if r.inflight and (n_out >= r.params.max_new_tokens or n_tok >= ctx):
                    continue
                decodes.append(r)
            elif pending > 1:
                partial.append(r)
        decodes.sort(key=_uid)
        return decodes, partial

    def _schedule_decodes(self, decodes: list[Req]) -> list[_Row]:
        for r in decodes:
            r.num_draft = self.spec.plan(r) if self.spec is not None else 0
        new_tokens = [1 + r.num_draft for r in decodes]
        needs = self.kv.pages_needed(decodes, new_tokens)
        need = sum(needs)
        while decodes and need > self.kv.available_pages:
            i = max(range(len(decodes)), key=lambda j: self._victim_key(decodes[j]))
            victim = decodes.pop(i)
            need -= needs.pop(i)
            new_tokens.pop(i)
            victim.num_draft = 0
            self._retract(victim)
        ok = self.kv.allocate_batch(decodes, new_tokens, needs)
        assert ok, "decode allocation failed after the capacity check"
        return [_Row(r, n, True, n > 1) for r, n in zip(decodes, new_tokens)]

    def _growth(self, r: Req) -> int:
        """Tokens a request may still add: its max_tokens, but never past the context."""
        return min(
            r.params.max_new_tokens - r.num_generated, self.context_length - r.num_tokens, 4096
        )

    def _growth_pages(self, r: Req) -> int:
        """Pages admission sets aside for a request's expected growth."""
        return int(self._growth(r) * self.new_token_ratio) // self.page_size

    def _reserve_pages(self) -> int:
        """Pages kept back for the growth of running requests (not reserved in full)."""
        tokens = sum(self._growth(r) for r in self.running if not r.finished)
        return int(tokens * self.new_token_ratio) // self.page_size

    def _schedule_prefill(self, partial: list[Req], budget: int) -> list[_Row]:
        rows: list[_Row] = []
        reserve = self._reserve_pages()
        for r in sorted(partial, key=_priority_key if self.by_priority else _admit_order):
            if budget <= 0:
                return rows
            n = min(r.pending, budget)
            if self.kv.pages_for(r, n) > self.kv.available_pages - reserve or not self.kv.allocate(
                r, n
            ):
                continue
            rows.append(_Row(r, n, n == r.pending))
            budget -= n
        admitted: dict[tuple[int, ...], list[Req]] = {}
        for req in self._waiting_in_policy_order():
            if budget <= 0:
                break
            if req.inflight:
                continue  # retracted with a token in flight: wait until its value is known
            if not self.kv.admit(req):  # no free row
                self._admission_blocked = self.by_priority
                break
            if self.kv.reuse and self._shares_uncached_prefix(req, admitted):
                self._unadmit(req)
                continue
            n = min(req.pending, budget)
            own = self._growth_pages(req)
            chunk_pages = self.kv.pages_for(req, n)
            need = chunk_pages + own
            # The growth estimate only holds back admission beside running requests: alone,
            # a request whose chunk fits must start (else the loop would spin forever).
            # (A chunk that cannot fit is not tried: allocate would evict the cache first.)
            short = need > self.kv.available_pages - reserve and bool(self.running)
            if short or chunk_pages > self.kv.available_pages or not self.kv.allocate(req, n):
                self._unadmit(req)
                self._admission_blocked = self.by_priority
                break  # in policy order: do not let later requests jump the queue
            self.waiting.remove(req)
            req.state = ReqState.RUNNING
            req.admit_order = next(self.admit_counter)
            if not req.admitted_once:
                req.cached_tokens, req.admitted_once = req.kv_len, True
                req.queue_time = time.monotonic() - req.arrived
            if _uses_penalties(req):
                self._restore_penalties(req)
            self.running.append(req)
            admitted.setdefault(_lead(req), []).append(req)
            rows.append(_Row(req, n, n == req.pending))
            budget -= n
            reserve += own
        return rows

    def _waiting_in_policy_order(self) -> list[Req]:
        reqs = list(self.waiting)  # by priority: already in order (_enqueue)
        if self.config.schedule_policy == "lpm" and self.kv.reuse and len(reqs) <= LPM_MAX_QUEUE:
            hits = {
                id(r): self.kv.cache.match_prefix(
                    r.token_slice(0, r.num_tokens - 1), count=False
                ).length
                for r in reqs
            }
            reqs.sort(key=lambda r: -hits[id(r)])  # stable: ties stay first-come first-served
        return reqs

    def _shares_uncached_prefix(self, req: Req, admitted: dict[tuple[int, ...], list[Req]]) -> bool:
        """True if an already-admitted request of this step computes the same prefix: wait for
        it to land in the cache instead of computing it twice. ``admitted`` buckets this
        step's requests by their leading tokens, so the check is cheap for unrelated prompts."""
        for other in admitted.get(_lead(req), ()):
            if _shares_prefix(req.prompt_ids, other.prompt_ids, req.kv_len + IN_BATCH_PREFIX_MIN):
                return True
        return False

    def _unadmit(self, req: Req) -> None:
        self.kv.release(req)

    def _retract(self, req: Req, overcommitted: bool = True) -> None:
        """Preempt: free the request's pages (its computed prefix stays in the cache) and requeue.
        Running out of pages means admission guessed too much room: start guessing
        conservatively again (not so when preempting for priority)."""
        self.num_retractions += 1
        if req in self.running:
            self.running.remove(req)
        self.kv.release(req)
        req.state = ReqState.WAITING
        self._enqueue(req, retracted=True)
        if overcommitted:
            self.new_token_ratio = self.config.init_new_token_ratio
        logger.debug("retracted request %s with %d output tokens", req.uid, len(req.output_ids))

    def _victim_key(self, req: Req) -> tuple[int, int]:
        """Retraction picks the largest: by priority the least important, then the latest to
        arrive (vLLM's choice); otherwise the latest admitted."""
        return (req.priority, req.arrival) if self.by_priority else (0, req.admit_order)

    def _preempt_for_priority(self) -> None:
        """Last step's admission stopped at a request for want of a row or pages: retract
        running requests of strictly lower priority (larger values) for the queue's head, at
        least one and then until its admission test would pass. (SGLang preempts for waiting
        requests like this; vLLM's priority preemption only covers running requests that run
        out of pages, which `_schedule_decodes` does here too.) Equal priorities never preempt
        each other, so requests cannot take turns evicting one another; the victims queue
        behind the head and keep their computed prefix in the cache."""
        head = next((r for r in self.waiting if not r.inflight), None)
        if head is None:
            return
        retracted = False
        while self.running:
            victim = max(self.running, key=self._victim_key)
            if victim.priority <= head.priority or (retracted and self._admissible(head)):
                return
            self._retract(victim, overcommitted=False)
            self.num_priority_preemptions += 1
            retracted = True

    def _admissible(self, req: Req) -> bool:
        """Whether admission would now take ``req`` (an estimate of `_schedule_prefill`'s test:
        a free row, and pages for its first chunk plus its expected growth beside the growth
        reserved for running requests)."""
        if not self.kv.free_rows:
            return False
        cached = self.kv.cached_prefix(req, count=False).length
        n = min(req.num_tokens - cached, self.engine.chunked_prefill_size)
        need = -(-n // self.page_size) + self._growth_pages(req)
        return need <= self.kv.available_pages - (self._reserve_pages() if self.running else 0)

    def _restore_penalties(self, req: Req) -> None:
        outputs = torch.tensor(req.output_ids, dtype=torch.long) if req.output_ids else None
        self.engine.penalties.reset_slot(req.row, torch.tensor(req.prompt_ids), outputs)

    # ------------------------------------------------------------ run
    def _launch(self, rows: list[_Row]) -> _InFlight:
        """Prepare and start one batch; nothing here waits for the device."""
        self.kv.flush()
        layout = BatchLayout(
            req_rows=[r.req.row for r in rows],
            prefix_lens=[r.req.kv_len for r in rows],
            extend_lens=[r.extend for r in rows],
            page_table=self.engine.page_table,
        )
        input_ids: list[int] = []
        from_device: list[tuple[int, int]] = []  # (flat position, page-table row)
        prompt_lp_index: list[int] = []  # flat positions whose logits score the next prompt token
        prompt_lp_targets: list[int] = []
        prompt_lp_reqs: list[tuple[Req, int]] = []
        for r in rows:
            req, start, end = r.req, r.req.kv_len, r.req.kv_len + r.extend
            if r.extend == 1 and req.output_ids and req.params.prompt_logprobs is None:
                # Decode (the common row): the one input is the newest token, known or not.
                if req.inflight:
                    from_device.append((len(input_ids), req.row))
                    input_ids.append(0)
                else:
                    input_ids.append(req.output_ids[-1])
                continue
            if req.params.prompt_logprobs is not None:
                # Positions p predict prompt token p + 1; skip what was reported before a retraction.
                lo = max(start, len(req.prompt_logprobs))
                hi = min(end, len(req.prompt_ids) - 1)
                if hi > lo:
                    base = len(input_ids) - start
                    prompt_lp_index += range(base + lo, base + hi)
                    prompt_lp_targets += req.prompt_ids[lo + 1 : hi + 1]
                    prompt_lp_reqs.append((req, hi - lo))
            if r.spec:  # the known last token, then places for the drafts (filled on device)
                input_ids += req.token_slice(start, start + 1) + [0] * req.num_draft
                continue
            known_end = min(end, req.num_known)
            input_ids += req.token_slice(start, known_end)
            if end > known_end:  # the last token was sampled by the batch still in flight
                from_device.append((len(input_ids), req.row))
                input_ids.append(0)
            if r.extend > 1 or req.num_generated == 0:
                self.prefill_tokens += r.extend
        # Positions and KV slots of every new token, gathered without a per-token loop.
        row_idx, positions = ranges(layout.req_rows, layout.prefix_lens, layout.extend_lens)
        out_slots = self.kv.host_table[row_idx, positions]
        sample_idx = [i for i, r in enumerate(rows) if r.samples and not r.spec]
        sampled = [rows[i].req for i in sample_idx]
        spec = None
        if self.spec is not None:
            # Before the target's forward: a draft model reads the rows' kv_len as it was.
            proposal = self.spec.propose([BatchRow(r.req, r.extend, r.spec) for r in rows])
            spec = self._spec_request(rows, proposal)
        sampling = self._sampling_rows(sampled) if sampled else None
        constrained = any(q.grammar is not None for q in sampled)
        bitmask = None
        if constrained:  # rows still waiting for the end of their reasoning are free
            live = [None if q.grammar_wait else q.grammar for q in sampled]
            if any(m is not None for m in live):
                bitmask = self.grammar.bitmask(live)
        prompt_lp = None
        if prompt_lp_reqs:
            k = max(q.params.prompt_logprobs or 0 for q, _ in prompt_lp_reqs)
            prompt_lp = PromptLogprobRequest(prompt_lp_index, prompt_lp_targets, k)
        out = self.engine.forward(
            layout,
            input_ids,
            positions,
            out_slots,
            sample_idx,
            sampling,
            self._sampling_key[1] if sampled else False,
            from_device,
            [q.row for q in sampled],
            prompt_lp,
            spec,
            [q.num_generated for q in sampled],
            bitmask,
        )
        for r in rows:
            r.req.kv_len += r.extend
        for q in sampled:
            q.inflight += 1
        self.new_token_ratio = max(
            self.config.min_new_token_ratio, self.new_token_ratio - self.ratio_decay
        )
        for r in rows:
            if r.extend > 1 and not r.spec:  # drafts are unverified: never cache them
                self.kv.cache_prefix(r.req)  # share prompt prefixes with requests still waiting
        spec_reqs = [r.req for r in rows if r.spec]
        return _InFlight(sampled, out, prompt_lp_reqs, spec_reqs, constrained)

    def _sampling_rows(self, sampled: list[Req]) -> SamplingRows:
        """Sampling parameters of these rows; rebuilt only when the rows change (a decode
        batch keeps its members for many steps)."""
        key = tuple(q.uid for q in sampled)
        if key != self._sampling_key[0] or self._sampling is None:
            self._sampling = SamplingRows.build(
                [q.params for q in sampled], [q.seed for q in sampled]
            )
            self._sampling_key = (key, any(_uses_penalties(q) for q in sampled))
        return self._sampling

    def _spec_request(self, rows: list[_Row], proposal: Proposal | None) -> SpecRequest | None:
        if proposal is None:
            return None
        k = self.spec_k
        index: list[int] = []  # k + 1 logits per row; short drafts repeat their last (ignored)
        fill: list[int] = []  # where each draft token goes in the flat input
        fill_src: list[int] = []
        reqs: list[Req] = []
        first = 0
        for r in rows:
            if r.spec:
                n, i = r.req.num_draft, len(reqs)
                index += [first + min(j, n) for j in range(k + 1)]
                fill += range(first + 1, first + 1 + n)
                fill_src += range(i * k, i * k + n)
                reqs.append(r.req)
            first += r.extend
        return SpecRequest(
            index=index,
            drafts=proposal.drafts,
            draft_probs=proposal.probs,
            fill=fill,
            fill_src=fill_src,
            temperatures=[q.params.temperature if not q.params.is_greedy else 0.0 for q in reqs],
            seeds=[q.seed for q in reqs],
            steps=[q.num_generated for q in reqs],
        )

    def _process(self, batch: _InFlight) -> list[Req]:
        """Turn a finished batch's samples into request progress and finish requests."""
        if batch.output is None:
            return []
        t0 = time.perf_counter()
        out = batch.output.to_host()  # the one host sync of the step
        t1 = time.perf_counter()
        self.stats["wait_s"] += t1 - t0
        if batch.prompt_lp_reqs:
            self._store_prompt_logprobs(batch.prompt_lp_reqs, out)
        if batch.spec_reqs:
            self._accept_drafts(batch.spec_reqs, out)
        tokens = out.next_tokens
        for i, req in enumerate(batch.reqs):
            req.inflight -= 1
            if req.finished:
                continue  # aborted while its batch was in flight: the sample is dropped
            req.output_ids.append(tokens[i])
            p = req.params
            if p.logprobs and out.chosen_logprobs is not None:
                req.output_logprobs.append(out.chosen_logprobs[i])
            if p.top_logprobs and out.top_ids is not None and out.top_logprobs is not None:
                k = p.top_logprobs
                req.output_top_logprobs.append(
                    list(zip(out.top_ids[i][:k], out.top_logprobs[i][:k]))
                )
            reason = self.stop_checker.check(req, self.context_length)
            if req.grammar is not None and _grammar_done(req, tokens[i]) and reason is None:
                reason = "stop"
            if reason is not None:
                self._finish(req, reason)
                if req in self.running:
                    self.running.remove(req)
                    self.kv.release(req)
                elif req in self.waiting:  # retracted while its last token was in flight
                    self.waiting.remove(req)
        self.stats["process_s"] += time.perf_counter() - t1
        return batch.reqs + batch.spec_reqs

    def _accept_drafts(self, reqs: list[Req], out: HostSamples) -> None:
        assert out.spec_tokens is not None and out.spec_counts is not None
        assert self.spec is not None
        for req, toks, n in zip(reqs, out.spec_tokens, out.spec_counts):
            old_kv = req.kv_len - 1 - req.num_draft
            self.stats["spec_rows"] += 1
            self.stats["spec_drafted"] += req.num_draft
            self.stats["spec_accepted"] += n - 1
            req.spec_verify_steps += 1
            req.spec_draft_tokens += req.num_draft
            req.spec_accepted_tokens += n - 1
            reason = None
            for tok in toks[:n]:
                req.output_ids.append(tok)
                reason = self.stop_checker.check(req, self.context_length)
                if reason is not None:
                    break
            # Roll back the rejected drafts: only verified tokens keep their KV.
            req.kv_len = min(old_kv + n, req.num_known - 1)
            self.spec.verified(req, n - 1)
            req.num_draft, req.draft = 0, []
            if reason is not None:
                self._finish(req, reason)
                self.running.remove(req)
                self.kv.release(req)

    @staticmethod
    def _store_prompt_logprobs(items: list[tuple[Req, int]], out: HostSamples) -> None:
        assert out.prompt_logprobs is not None
        i = 0
        for req, n in items:
            k = req.params.prompt_logprobs or 0
            req.prompt_logprobs += out.prompt_logprobs[i : i + n]
            if k and out.prompt_top_ids is not None and out.prompt_top_logprobs is not None:
                for ids, lps in zip(
                    out.prompt_top_ids[i : i + n], out.prompt_top_logprobs[i : i + n]
                ):
                    req.prompt_top_logprobs.append(list(zip(ids[:k], lps[:k])))
            i += n

    def _finish(self, req: Req, reason: str) -> None:
        req.state = ReqState.FINISHED
        req.finish_reason = reason

    # ------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        assert self.inflight is None, "integrity is checked between batches"
        self.kv.check_integrity(self.running)

    def flush_cache(self) -> bool:
        if self.running:
            return False
        self.kv.cache.reset()
        return True


def overlap_default(device_type: str, disabled: bool) -> bool:
    """Overlap on CUDA unless switched off by --disable-overlap-scheduling."""
    return device_type == "cuda" and not disabled


def _grammar_done(req: Req, token: int) -> bool:
    """Advance the request's matcher by its new token; True once the grammar is complete
    (it accepted a stop token, or nothing can follow). While the request waits for the end
    of its reasoning the token only counts towards that marker (grammar.py)."""
    wait = req.grammar_wait
    if wait:
        if token == wait[-1] and tuple(req.output_ids[-len(wait) :]) == wait:
            req.grammar_wait = ()  # the reasoning ended: the grammar applies from now on
        return False
    matcher: Any = req.grammar
    if not matcher.accept_token(token):
        # Only allowed tokens are sampled; this would be a bug, so end the request visibly.
        logger.error("request %s sampled token %d outside its grammar", req.uid, token)
        return True
    return bool(matcher.is_terminated())


def _uid(req: Req) -> int:
    return req.uid


def _admit_order(req: Req) -> int:
    return req.admit_order


def _priority_key(req: Req) -> tuple[int, int]:
    return (req.priority, req.arrival)


def _uses_penalties(req: Req) -> bool:
    p = req.params
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _lead(req: Req) -> tuple[int, ...]:
    return tuple(req.prompt_ids[:IN_BATCH_PREFIX_MIN])


def _shares_prefix(a: list[int], b: list[int], n: int) -> bool:
    """Whether a and b agree on their first n tokens. List comparisons run in C; the window
    past the cached part goes first, as it tells apart requests that share only a cached
    system prompt (the usual case) without comparing the thousands of tokens before it."""
    if len(a) < n or len(b) < n:
        return False
    lo = n - IN_BATCH_PREFIX_MIN
    return a[lo:n] == b[lo:n] and a[:lo] == b[:lo]
