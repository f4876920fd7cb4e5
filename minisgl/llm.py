"""Offline API: the engine and scheduler in-process, no IPC.

    from minisgl import LLM, SamplingParams
    llm = LLM()                      # bundled SmolLM2-135M-Instruct
    llm.generate(["Hello"], SamplingParams(max_tokens=32))

Tensor parallelism: ``LLM(model, tp_size=N)`` makes this process rank 0 and spawns ranks
1..N-1 (see minisgl/tp/); every scheduler call is mirrored to them, and they exit on
``close()`` (or ``with LLM(...) as llm:``, or garbage collection, or when this process dies).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from minisgl.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.sampling_params import SamplingParams
from minisgl.scheduler.plugins import counter_fields
from minisgl.scheduler.request import Req
from minisgl.scheduler.scheduler import Scheduler
from minisgl.scheduler.stop import TokenizerDecoder, regex_cut
from minisgl.tokenizer import load_tokenizer, render_chat, trim_stop

if TYPE_CHECKING:
    from minisgl.tp.mirror import MirroredScheduler

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str | None = None, **options: object) -> None:
        self._start(EngineConfig.from_kwargs(model=model, **options))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self._tp_teardown: Callable[[], None] | None = None
        self.config = config
        if config.tp_size == 1:
            self.engine = Engine(config)
            self.tokenizer = load_tokenizer(self.engine.resolved, config.tokenizer)
            decode = TokenizerDecoder(self.tokenizer)
            self.scheduler: Scheduler | MirroredScheduler = Scheduler(self.engine, decode=decode)
            return
        from minisgl.tp.offline import start_offline_tp

        run = start_offline_tp(config, self)
        self._tp_teardown, self.followers = run.teardown, run.followers
        self.engine, self.tokenizer, self.scheduler = run.engine, run.tokenizer, run.scheduler

    def close(self) -> None:
        """Stop the TP ranks and leave the process group, then free this process's engine
        (weights, KV pool, CUDA graphs), so that another LLM in the process can size its KV
        pool from the memory. Idempotent; generate() afterwards raises."""
        if self._tp_teardown is not None:
            self._tp_teardown()
        engine = self.__dict__.pop("engine", None)
        self.__dict__.pop("scheduler", None)
        if engine is None:
            return
        device = engine.device
        del engine
        # The engine's objects refer to each other: only a collection frees them now, and
        # only then can the caching allocator hand the memory back.
        gc.collect()
        if device.type == "cuda":
            import torch

            torch.cuda.empty_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: at least one token is required")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        return [int(t) for t in prompt]

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[dict[str, object]]:
        """Generate for every prompt; results come back in input order. ``priority`` (vLLM's
        argument) gives one integer per prompt, lower first; it needs
        ``schedule_policy="priority"`` unless all are 0."""
        if "scheduler" not in self.__dict__:
            raise RuntimeError(
                "this LLM is closed: its engine is freed, its TP ranks (if any) shut down"
            )
        batch: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [prompts]  # type: ignore[list-item]
        else:
            batch = list(prompts)  # type: ignore[arg-type]
        prompts = batch
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(
                f"sampling_params has {len(params)} entries for {len(prompts)} prompts"
            )
        priorities = self._priorities(priority, len(prompts))
        # Validate everything before queueing anything, so a bad prompt loses nothing.
        encoded = [self.encode(p) for p in prompts]
        for ids, p, prio in zip(encoded, params, priorities, strict=True):
            self.scheduler.check_request(ids, p, prio)
        items = [
            (ids, p, prio)
            for ids, p, prio in zip(encoded, params, priorities, strict=True)
            for _ in range(p.n)
        ]
        if isinstance(self.scheduler, Scheduler):
            reqs = [self.scheduler.add_request(ids, p, priority=prio) for ids, p, prio in items]
        else:
            reqs = self.scheduler.add_requests(items)  # one message to the ranks
        self._run(reqs, use_tqdm if use_tqdm is not None else len(reqs) >= 8)
        return [self._result(r) for r in reqs]

    def _priorities(self, priority: Sequence[int] | None, n: int) -> list[int]:
        if priority is None:
            return [0] * n
        if isinstance(priority, (str, bytes)) or not isinstance(priority, Sequence):
            raise ValueError(
                f"priority must be a list of integers (one per prompt), got {priority!r}"
            )
        if len(priority) != n:
            raise ValueError(f"priority must have one entry per prompt: {len(priority)} for {n}")
        return [self.scheduler.check_priority(p) for p in priority]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
        continue_final_message: bool = False,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, object]] | None = None,
    ) -> list[dict[str, object]]:
        """Generate replies to one conversation or a list of them (see apply_chat_template).
        Replies are text; the structured_output extension's ``tool_calls.parse_tool_calls``
        splits out calls."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [
            self.apply_chat_template(
                c,  # type: ignore[arg-type]
                chat_template_kwargs,
                continue_final_message,
                add_generation_prompt,
                tools,
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        chat_template_kwargs: Mapping[str, object] | None = None,
        continue_final_message: bool = False,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, object]] | None = None,
    ) -> list[int]:
        """Token ids of a conversation: ``chat_template_kwargs`` go to the template (e.g.
        ``{"enable_thinking": False}`` for Qwen3); ``continue_final_message`` continues the
        last (assistant) message instead of starting a new reply; ``tools`` (OpenAI function
        tools) go to the template too."""
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompts as token ids")
        return render_chat(
            self.tokenizer,
            messages,
            chat_template_kwargs,
            continue_final_message,
            add_generation_prompt,
            tools,
        )

    def _run(self, reqs: list[Req], show_progress: bool) -> None:
        bar = None
        if show_progress:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), desc="generate", unit="req")
        pending = {r.uid for r in reqs}
        while pending:
            for r in self.scheduler.step():
                if r.finished and r.uid in pending:
                    pending.discard(r.uid)
                    if bar is not None:
                        bar.update(1)
            if not self.scheduler.has_work and pending:
                raise RuntimeError("scheduler went idle with unfinished requests")
        # Under overlap scheduling one more batch may be in flight; land it so that the
        # engine is idle (and its pages accounted for) when generate returns.
        self.scheduler.drain()
        if bar is not None:
            bar.close()

    def _result(self, req: Req) -> dict[str, object]:
        p = req.params
        text = (
            self.tokenizer.decode(req.output_ids, skip_special_tokens=p.skip_special_tokens)
            if self.tokenizer is not None
            else ""
        )
        cut = regex_cut(req)
        if cut is not None:
            text = text[:cut]  # the scheduler's matcher saw this same text (same decoding)
        elif isinstance(req.matched_stop, str):
            text = trim_stop(text, req.matched_stop)
        out: dict[str, object] = {
            "text": text,
            "token_ids": list(req.output_ids),
            "finish_reason": req.finish_reason,
            "matched_stop": req.matched_stop,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
        }
        if p.logprobs:
            out["logprobs"] = list(req.output_logprobs)
        if p.top_logprobs:
            out["top_logprobs"] = [dict(t) for t in req.output_top_logprobs]
        out.update(counter_fields(self.config, req.counters))
        if p.prompt_logprobs is not None:
            out["prompt_logprobs"] = list(req.prompt_logprobs)
            if p.prompt_logprobs:
                out["prompt_top_logprobs"] = [dict(t) for t in req.prompt_top_logprobs]
        return out
