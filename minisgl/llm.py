"""Offline API: the engine and scheduler in-process, no IPC.

    from minisgl import LLM, SamplingParams
    llm = LLM()                      # bundled SmolLM2-135M-Instruct
    llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from minisgl.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.sampling_params import SamplingParams
from minisgl.scheduler.request import Req
from minisgl.scheduler.scheduler import Scheduler
from minisgl.tokenizer import load_tokenizer, trim_stop

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **options)
        self.engine = Engine(self.config)
        self.tokenizer = load_tokenizer(self.engine.resolved, self.config.tokenizer)
        self.scheduler = Scheduler(self.engine, decode=self._decode)

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

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
    ) -> list[dict[str, Any]]:
        """Generate for every prompt; results come back in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
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
        for p in params:
            p.validate()
        # Validate everything before queueing anything, so a bad prompt loses nothing.
        encoded = [self.encode(p) for p in prompts]
        for ids in encoded:
            self.scheduler.check_prompt(ids)
        reqs: list[Req] = []
        for ids, p in zip(encoded, params):
            for _ in range(p.n):
                reqs.append(self.scheduler.add_request(ids, p))
        self._run(reqs, use_tqdm if use_tqdm is not None else len(reqs) >= 8)
        return [self._result(r) for r in reqs]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[dict[str, Any]]:
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.apply_chat_template(c) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

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

    def _result(self, req: Req) -> dict[str, Any]:
        p = req.params
        text = (
            self.tokenizer.decode(req.output_ids, skip_special_tokens=p.skip_special_tokens)
            if self.tokenizer is not None
            else ""
        )
        if isinstance(req.matched_stop, str):
            text = trim_stop(text, req.matched_stop)
        out: dict[str, Any] = {
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
        return out
