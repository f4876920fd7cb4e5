"""The tokenizer/detokenizer worker process.

Inbox messages come from the API server (requests, aborts, control) and from the scheduler
(per-step token outputs, control replies). Requests are tokenized and forwarded to the
scheduler; token outputs become text deltas for the API server. Text-level rules live here:
multi-byte characters are held back until complete, text that may begin a stop string is held
back, a stop string is cut off, and a matched stop token's text is dropped.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from functools import lru_cache
from multiprocessing.queues import Queue
from pathlib import Path

import zmq

from minisgl.ipc import sockets
from minisgl.ipc.child import (
    ChildReport,
    freeze_startup_heap,
    parent_alive,
    run_child,
    setup_child,
    startup_report,
)
from minisgl.ipc.messages import (
    AbortRequests,
    AddRequests,
    ControlReply,
    ControlRequest,
    StepOutputs,
    SubmitItem,
    SubmitRequest,
    TextOutput,
    TextOutputs,
    TokenizedRequest,
    TokenOutput,
)
from minisgl.tokenizer import Tokenizer, render_chat
from minisgl.tokenizer.detokenize import IncrementalDetokenizer, StopStringFilter
from minisgl.tokenizer.stop_regex import StopRegexFilter

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000  # how often an idle worker checks that its parent is still alive
# vLLM's floor for logprobs: a token a grammar ruled out has log(0) = -inf, which JSON cannot
# carry (a non-streamed response failed with a 500; a stream sent "-Infinity").
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class WorkerArgs:
    model: str | None
    tokenizer: str | None
    addresses: sockets.IpcAddresses
    # The worker saves a fast-loading copy of the tokenizer here for the scheduler's
    # stop-string checks (building a tokenizer from a GGUF file takes many seconds).
    tokenizer_copy_dir: str
    parent_pid: int
    log_level: str = "info"


@dataclass
class _Stream:
    """Per-request text state."""

    detok: IncrementalDetokenizer
    stops: StopStringFilter
    regexes: StopRegexFilter | None  # None without stop_regex
    min_tokens: int
    prompt_text: str | None = None
    prompt_token_strs: list[str] | None = None
    first: bool = True


def run_worker(args: WorkerArgs, report_queue: Queue[ChildReport]) -> None:
    """Entry point of the worker process (spawned)."""
    setup_child(args.log_level)
    run_child(lambda: _serve(args, report_queue))


def keep_to_one_thread() -> None:
    """This process computes nothing heavy: its torch threads (transformers loads torch) would
    only contend with the engine's for the cores (a spinning OpenMP team slows the engine's
    steps several-fold on a busy CPU)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def _serve(args: WorkerArgs, report_queue: Queue[ChildReport]) -> None:
    with startup_report("tokenizer", report_queue) as ready:
        from minisgl.models.resolve import resolve_model_path
        from minisgl.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(resolve_model_path(args.model), args.tokenizer)
        keep_to_one_thread()
        save_tokenizer_copy(tokenizer, Path(args.tokenizer_copy_dir))
        worker = Worker(tokenizer, args)
        ready({"chat_template": bool(getattr(tokenizer, "chat_template", None))})
        freeze_startup_heap()
        worker.run()


def save_tokenizer_copy(tokenizer: Tokenizer, target: Path) -> None:
    # Write under a temporary name and rename: the directory appears complete or not at all.
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


class Worker:
    def __init__(self, tokenizer: Tokenizer, args: WorkerArgs) -> None:
        self.tokenizer = tokenizer
        self.parent_pid = args.parent_pid
        self.ctx = zmq.Context()
        self.inbox = sockets.bind_pull(self.ctx, args.addresses.worker)
        self.to_scheduler = sockets.connect_push(self.ctx, args.addresses.scheduler)
        self.to_api = sockets.connect_push(self.ctx, args.addresses.frontend)
        self.streams: dict[int, _Stream] = {}
        self.token_text = lru_cache(maxsize=1 << 16)(self._token_text)

    def _token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def run(self) -> None:
        try:
            self._loop()
        finally:
            # Close the sockets explicitly: a context with open sockets would block exit.
            self.ctx.destroy(linger=sockets.LINGER_MS)

    def _loop(self) -> None:
        while True:
            msgs = sockets.recv_all(self.inbox, IDLE_POLL_MS)
            if not msgs and not parent_alive(self.parent_pid):
                logger.warning("parent process is gone; exiting")
                return
            outputs: list[TextOutput] = []
            for msg in msgs:
                try:
                    self._handle(msg, outputs)
                except Exception:
                    # One bad message must not take the worker (and every request) down.
                    logger.exception("failed to handle %s", type(msg).__name__)
            if outputs:
                sockets.send(self.to_api, TextOutputs(outputs))

    def _handle(self, msg: object, outputs: list[TextOutput]) -> None:
        if isinstance(msg, SubmitRequest):
            self._submit(msg, outputs)
        elif isinstance(msg, StepOutputs):
            for out in msg.outputs:
                try:
                    self._on_tokens(out, outputs)
                except Exception as exc:
                    logger.exception("detokenizing request %d failed", out.rid)
                    self._fail(out.rid, f"detokenization failed: {exc}", outputs)
        elif isinstance(msg, AbortRequests | ControlRequest):
            sockets.send(self.to_scheduler, msg)
        elif isinstance(msg, ControlReply):
            msg.data["worker_streams"] = len(self.streams)
            sockets.send(self.to_api, msg)
        else:
            logger.error("unexpected message %r", type(msg).__name__)

    # ------------------------------------------------------------ requests
    def _submit(self, msg: SubmitRequest, outputs: list[TextOutput]) -> None:
        try:
            reqs = [
                TokenizedRequest(i.rid, self._tokenize(i), i.params, i.priority) for i in msg.items
            ]
        except Exception as exc:  # template errors, bad roles, ... : the client's fault
            error = f"could not tokenize the prompt: {exc}"
            outputs += [_error_output(item.rid, error, 400) for item in msg.items]
            return
        for item, req in zip(msg.items, reqs, strict=True):
            p = item.params
            stream = _Stream(
                detok=IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens),
                stops=StopStringFilter(p.stop_strings),
                regexes=StopRegexFilter(p.stop_regexes) if p.stop_regexes else None,
                min_tokens=p.min_tokens,
            )
            if item.return_prompt_text:
                stream.prompt_text = (
                    item.text if item.text is not None else self._decode(req.input_ids)
                )
            if item.return_prompt_tokens:
                stream.prompt_token_strs = [self.token_text(t) for t in req.input_ids]
            self.streams[item.rid] = stream
        sockets.send(self.to_scheduler, AddRequests(reqs))

    def _tokenize(self, item: SubmitItem) -> list[int]:
        if item.input_ids is not None:
            return list(map(int, item.input_ids))  # no Python loop per token
        if item.messages is not None:
            return render_chat(
                self.tokenizer,
                item.messages,
                item.chat_template_kwargs,
                item.continue_final_message,
                item.add_generation_prompt,
                item.tools,
            )
        return list(self.tokenizer.encode(item.text or "", add_special_tokens=True))

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    # ------------------------------------------------------------ outputs
    def _on_tokens(self, out: TokenOutput, outputs: list[TextOutput]) -> None:
        stream = self.streams.get(out.rid)
        if stream is None:
            return  # already finished here (stopped by a stop string, or failed)
        if out.error is not None:
            del self.streams[out.rid]
            outputs.append(_error_output(out.rid, out.error, out.error_status or 500, out))
            return
        text, reason, matched = self._text(stream, out)
        for lp in (out.logprobs or []) + (out.prompt_logprobs or []):
            lp.token = self.token_text(lp.token_id)
            lp.logprob = max(lp.logprob, LOGPROB_FLOOR)
            for alt in lp.top:
                alt.token = self.token_text(alt.token_id)
                alt.logprob = max(alt.logprob, LOGPROB_FLOOR)
        result = TextOutput(
            rid=out.rid,
            text=text,
            token_ids=out.new_ids,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            finish_reason=reason,
            matched_stop=matched,
            logprobs=out.logprobs,
            prompt_logprobs=out.prompt_logprobs,
            queue_time=out.queue_time,
            counters=out.counters,
        )
        if stream.first:
            result.prompt_text = stream.prompt_text
            result.prompt_token_strs = stream.prompt_token_strs
            stream.first = False
        if reason is not None:
            del self.streams[out.rid]
        outputs.append(result)

    def _text(self, stream: _Stream, out: TokenOutput) -> tuple[str, str | None, int | str | None]:
        """The text ``out`` adds, and the finish (reason, matched stop) it ends with: the
        scheduler's, or a stop string / regex found here."""
        finished = out.finish_reason is not None
        text_ids = out.new_ids
        if finished and isinstance(out.matched_stop, int) and text_ids:
            text_ids = text_ids[:-1]  # the stop token (EOS or a stop id) is not part of the text
        raw = stream.detok.add(text_ids)
        if finished:
            raw += stream.detok.flush()
        check = out.completion_tokens >= stream.min_tokens
        text = stream.stops.feed(raw, check=check)
        reason, matched = out.finish_reason, out.matched_stop
        if stream.stops.matched is not None:
            if not finished:
                # The scheduler decodes only a tail of tokens, so in rare cases the full text
                # shows a stop string first: finish here and free the request's KV.
                sockets.send(self.to_scheduler, AbortRequests([out.rid]))
            reason, matched, finished = "stop", stream.stops.matched, True
        elif finished:
            text += stream.stops.flush()
        if stream.regexes is not None:
            # Over the text the stop strings let through: the scheduler's matcher, which
            # decides where generation ends, sees the same text and finds the same match.
            text = stream.regexes.feed(text, check=check)
            if stream.regexes.matched is not None:
                if not finished:  # a safety net only: the scheduler should have ended it
                    sockets.send(self.to_scheduler, AbortRequests([out.rid]))
                reason, matched = "stop", stream.regexes.matched
            elif finished:
                text += stream.regexes.flush()
        return text, reason, matched

    def _fail(self, rid: int, message: str, outputs: list[TextOutput]) -> None:
        if self.streams.pop(rid, None) is not None:
            sockets.send(self.to_scheduler, AbortRequests([rid]))
            outputs.append(_error_output(rid, message, 500))


def _error_output(
    rid: int, message: str, status: int, out: TokenOutput | None = None
) -> TextOutput:
    return TextOutput(
        rid=rid,
        text="",
        token_ids=[],
        prompt_tokens=out.prompt_tokens if out else 0,
        completion_tokens=out.completion_tokens if out else 0,
        finish_reason="abort",
        error=message,
        error_status=status,
    )
