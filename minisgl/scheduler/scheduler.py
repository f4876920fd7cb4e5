"""The scheduler: continuous batching with chunked prefill, mixed batches and preemption.

Each ``step`` builds one batch, runs it through the engine, and turns the sampled tokens into
request progress. A batch holds every running decode (decode.py) plus prefill chunks of
running and newly admitted requests within a token budget (admission.py); when pages run
out, requests are retracted (preemption.py). With overlap scheduling the next batch is
launched before the previous one's samples are read back, so the host prepares step N + 1
while the device runs step N. The step's inputs are built by step_builder.py; extensions
(speculative decoding, structured output) plug in through plugins.py.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Sequence

import torch

from minisgl.engine.engine import Engine
from minisgl.kvcache.tier import make_tier
from minisgl.sampling_params import SamplingParams
from minisgl.scheduler.admission import Admission
from minisgl.scheduler.decode import DecodeRows
from minisgl.scheduler.kv_manager import KVManager
from minisgl.scheduler.plugins import make_constraints, make_speculator
from minisgl.scheduler.policy import Policy, check_priority
from minisgl.scheduler.preemption import Preemption
from minisgl.scheduler.request import Req, ReqState, Row
from minisgl.scheduler.results import Results
from minisgl.scheduler.step_builder import Launched, StepBuilder
from minisgl.scheduler.stop import StopChecker, TokenizerDecoder

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        decode: TokenizerDecoder | None = None,
        overlap: bool | None = None,
    ) -> None:
        self.engine = engine
        self.config = cfg = engine.config
        self.context_length = engine.context_length
        self.page_size = cfg.page_size
        self.kv = KVManager(
            engine.page_table,
            engine.pool.num_pages,
            cfg.page_size,
            engine.max_running_requests,
            cfg.cache,
            engine.stager,
            make_tier(cfg, engine.pool),
        )
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.policy = Policy(cfg.schedule_policy)
        queues = (self.kv, self.policy, self.waiting, self.running)
        self.admission = Admission(*queues, engine, self._restore_penalties)
        self.preemption = Preemption(*queues, self.admission)
        self.speculator = make_speculator(engine, self.kv)
        if self.speculator is not None:
            self.kv.cacheable = self.speculator.cacheable
        self.constraints = make_constraints(engine, lambda: decode.tokenizer if decode else None)
        self.decodes = DecodeRows(self.kv, self.preemption, self.speculator, self.context_length)
        self.builder = StepBuilder(engine, self.kv, self.speculator, self.constraints)
        self.stop_checker = StopChecker(engine.model_config.eos_token_ids, decode)
        self.results = Results(
            self.stop_checker, self.constraints, self.speculator, self.context_length, self._finish
        )
        # Overlap pays off only when the device runs asynchronously; on CPU it can be forced
        # (tests do, to check the one-step-late bookkeeping). Speculation reads each step's
        # result before drafting the next: no overlap.
        if overlap is None:
            overlap = overlap_default(engine.device.type, cfg.disable_overlap_scheduling)
        self.overlap = overlap and self.speculator is None
        self.inflight: Launched | None = None
        self.rng = random.Random(cfg.seed)
        self.uids = itertools.count()
        self.arrivals = itertools.count()
        # Where host time goes: benchmarks print these to tell CPU- from GPU-bound runs.
        self.stats: dict[str, float] = {"steps": 0, "decode_steps": 0}
        self.stats.update(dict.fromkeys(("launch_s", "wait_s", "process_s"), 0.0))
        # What plug-ins count over the run (speculation: drafts verified and accepted).
        self.totals: dict[str, int] = {}
        if self.speculator is not None:
            self.speculator.totals = self.totals
        if self.kv.tier is not None:
            self.kv.tier.totals = self.totals

    # ------------------------------------------------------------ requests
    def check_request(
        self, prompt_ids: Sequence[int], params: SamplingParams, priority: object = 0
    ) -> None:
        """ValueError naming the problem if this request can never be served: its prompt, its
        priority under this scheduler's policy, or a constraint that does not compile."""
        self.check_prompt(prompt_ids)
        self.check_priority(priority)
        self._start_constraint(params, prompt_ids)  # compiled constraints are cached
        if self.speculator is not None:
            self.speculator.check(params)

    def check_priority(self, priority: object) -> int:
        """The request's priority, or ValueError naming ``priority`` (policy.py)."""
        return check_priority(priority, self.policy.name)

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
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

    def _start_constraint(self, params: SamplingParams, prompt_ids: Sequence[int]) -> object | None:
        grammar = params.grammar
        if grammar is None:
            return None
        if self.constraints is None:
            raise ValueError(
                f"{grammar[0]} needs structured output, which this installation lacks "
                "(the minisgl.extensions.structured_output package)"
            )
        return self.constraints.start(params, prompt_ids)

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        uid: int | None = None,
        priority: int = 0,
    ) -> Req:
        self.check_request(prompt_ids, params, priority)
        seed = params.seed if params.seed is not None else self.rng.getrandbits(62)
        req = Req(
            uid=next(self.uids) if uid is None else uid,
            prompt_ids=list(prompt_ids),
            params=params,
            seed=seed,
            constraint=self._start_constraint(params, prompt_ids),
            priority=priority,
            arrival=next(self.arrivals),
        )
        self.policy.enqueue(self.waiting, req, retracted=False)
        return req

    def abort(self, uid: int) -> Req | None:
        for req in self.waiting:
            if req.uid == uid:
                self.waiting.remove(req)
                self._finish(req, "abort")
                return req
        for req in self.running:
            if req.uid == uid:
                self._finish(req, "abort")
                return req
        return None

    def drain(self) -> list[Req]:
        """Read back the batch still in flight (overlap mode), e.g. before going idle."""
        launched, self.inflight = self.inflight, None
        return self._process(launched) if launched is not None else []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.inflight)

    @property
    def num_retractions(self) -> int:
        return self.preemption.num_retractions

    @property
    def num_priority_preemptions(self) -> int:
        return self.preemption.num_priority_preemptions

    @property
    def prefill_tokens(self) -> int:
        return self.builder.prefill_tokens

    # ------------------------------------------------------------ step
    def step(self) -> list[Req]:
        """Run one batch; returns the requests that got a token or finished."""
        prev, self.inflight = self.inflight, None
        done: list[Req] = []
        # A constrained row's next bitmask needs the token it just sampled.
        if prev is not None and (not self.overlap or prev.constrained):
            done, prev = self._process(prev), None
        t0 = time.perf_counter()
        rows = self._schedule(busy=prev is not None)
        if rows:
            self.inflight = self._launch(rows)
        self.stats["launch_s"] += time.perf_counter() - t0
        if prev is not None:
            done = self._process(prev)
        if not self.overlap and self.inflight is not None:
            done += self._process(self.inflight)
            self.inflight = None
        return done

    def _schedule(self, busy: bool = False) -> list[Row]:
        """The next batch's rows. ``busy``: a batch is still in flight (overlap), so its
        results may yet finish requests and free their pages."""
        if self.admission.blocked:
            self.admission.blocked = False
            self.preemption.for_priority()
        mixed = not self.config.disable_mixed_batch
        decodes, partial = self.decodes.split(self.running)
        rows: list[Row] = []
        if mixed or not (partial or self.waiting):
            rows = self.decodes.schedule(decodes)
        # Decode rows count against the step's token budget (a step's length is its
        # latency for every stream), but prefill always keeps a quarter of it: with as many
        # decodes as the budget, a chunked prompt would otherwise wait for one to finish.
        chunk = self.engine.chunked_prefill_size
        budget = max(chunk - len(rows), chunk // 4)
        if mixed or not rows:
            rows += self.admission.schedule(partial, budget)
        if not rows and decodes and not mixed:
            rows = self.decodes.schedule(decodes)
        if not rows and self.running and not busy:
            # Nothing could get memory: give the policy's last request's pages back and retry.
            # Not while a batch is in flight: the running requests may then only be waiting
            # for their last token (nothing to schedule is no shortage), and if pages are
            # short, the next step, with nothing in flight, still retracts.
            self.preemption.retract(self.running[self.preemption.victim(self.running)])
        return rows

    def _launch(self, rows: list[Row]) -> Launched:
        step, launched = self.builder.build(rows)
        launched.pending = self.engine.forward(step)
        for r in rows:
            r.req.kv_len += r.extend
        for q in launched.sampled:
            q.inflight += 1
        self.admission.decay()
        for r in rows:
            if r.extend > 1 and not r.drafts:  # drafts are unverified: never cache them
                self.kv.cache_prefix(r.req)  # share prompt prefixes with requests still waiting
        self.stats["steps"] += 1
        self.stats["decode_steps"] += all(r.extend == 1 for r in rows)
        return launched

    def _restore_penalties(self, req: Req) -> None:
        if not req.params.uses_penalties:
            return
        outputs = torch.tensor(req.output_ids, dtype=torch.long) if req.output_ids else None
        self.engine.penalties.reset_slot(req.row, torch.tensor(req.prompt_ids), outputs)

    # ------------------------------------------------------------ results
    def _process(self, launched: Launched) -> list[Req]:
        """Turn a finished batch's samples into request progress and finish requests."""
        if launched.pending is None:
            return []
        t0 = time.perf_counter()
        out = launched.pending.result()  # the one host sync of the step
        t1 = time.perf_counter()
        self.stats["wait_s"] += t1 - t0
        self.results.apply(launched, out)
        self.stats["process_s"] += time.perf_counter() - t1
        return launched.sampled + [r.req for r in launched.drafts]

    def _finish(self, req: Req, reason: str) -> None:
        """End the request: its pages go back (what it computed stays in the prefix cache)."""
        req.state = ReqState.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
            self.kv.release(req)
        elif req in self.waiting:  # retracted while its last token was in flight
            self.waiting.remove(req)
        if self.speculator is not None:
            self.speculator.release(req)

    # ------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        assert self.inflight is None, "integrity is checked between batches"
        self.kv.check_integrity(self.running)
        if self.speculator is not None:
            self.speculator.check_integrity(self.running)

    def flush_cache(self) -> bool:
        if self.running:
            return False
        self.kv.cache.reset()
        return True


def overlap_default(device_type: str, disabled: bool) -> bool:
    """Overlap on CUDA unless switched off by --disable-overlap-scheduling."""
    return device_type == "cuda" and not disabled
