"""Interactive multi-turn chat in the terminal, with the engine in-process (no server).

    python -m minisgl --shell [engine flags]

/reset clears the conversation, /exit (or Ctrl-D) leaves, Ctrl-C stops the current answer.
With --tp-size N the shell is rank 0 of an offline TP run (see minisgl/llm.py): it spawns the
other ranks, and they leave with it.
Sampling is set with --temperature, --top-p and --max-tokens (shell flags).
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable, Iterator

from minisgl.config import EngineConfig
from minisgl.sampling_params import SamplingParams
from minisgl.tokenizer import render_chat
from minisgl.tokenizer.detokenize import IncrementalDetokenizer

PROMPT = ">>> "
HELP = "Type a message. /reset clears the conversation, /exit leaves, Ctrl-C stops an answer."


class ChatSession:
    """A conversation with the in-process scheduler; answers are streamed to ``write``."""

    def __init__(self, config: EngineConfig, params: SamplingParams) -> None:
        from minisgl.llm import LLM

        # The offline LLM builds the engine, tokenizer and scheduler; with TP its scheduler
        # mirrors every call to the other ranks, which it starts and stops.
        self.llm = LLM.from_config(config)
        self.engine = self.llm.engine
        self.tokenizer = self.llm.tokenizer
        self.scheduler = self.llm.scheduler
        self.history: list[dict[str, str]] = []
        self.params = params

    def close(self) -> None:
        self.llm.close()

    def reset(self) -> None:
        self.history.clear()

    def _prompt_ids(self) -> list[int]:
        """The conversation rendered by the chat template; the oldest turns are dropped when
        it no longer leaves room for an answer."""
        room = min(self.params.max_new_tokens, self.scheduler.context_length // 2)
        while True:
            ids = render_chat(self.tokenizer, self.history)
            if len(ids) + room <= self.scheduler.context_length or len(self.history) <= 1:
                return ids
            del self.history[:2]

    def ask(self, text: str, write: Callable[[str], object]) -> str:
        self.history.append({"role": "user", "content": text})
        ids = self._prompt_ids()
        room = self.scheduler.context_length - len(ids)
        if room < 1:
            self.history.pop()
            raise ValueError("the message is longer than the model's context")
        params = self.params.with_max_tokens(min(self.params.max_new_tokens, room))
        req = self.scheduler.add_request(ids, params)
        detok = IncrementalDetokenizer(self.tokenizer)
        answer: list[str] = []
        seen = 0
        with _interruptible() as interrupted:
            while not req.finished:
                # Ctrl-C only sets a flag: stopping inside a step would leave it half-done.
                if interrupted():
                    self.scheduler.abort(req.uid)
                    write(" [stopped]")
                    break
                self.scheduler.step()
                new = req.output_ids[seen:]
                seen = len(req.output_ids)
                if req.finished and isinstance(req.matched_stop, int) and new:
                    new = new[:-1]  # the end-of-turn token is not part of the answer
                delta = detok.add(new) + (detok.flush() if req.finished else "")
                if delta:
                    answer.append(delta)
                    write(delta)
        reply = "".join(answer)
        self.history.append({"role": "assistant", "content": reply})
        return reply


@contextlib.contextmanager
def _interruptible() -> Iterator[Callable[[], bool]]:
    hits: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: hits.append(signum))
    try:
        yield lambda: bool(hits)
    finally:
        signal.signal(signal.SIGINT, previous)


def _line_reader() -> Callable[[str], str]:
    if sys.stdin.isatty() and sys.stdout.isatty():
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import InMemoryHistory

        session: PromptSession[str] = PromptSession(history=InMemoryHistory())
        return lambda prompt: session.prompt(prompt)
    return input  # piped input: plain lines, no line editing


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def run_shell(config: EngineConfig, params: SamplingParams) -> int:
    print("Loading the model...", flush=True)
    try:
        chat = ChatSession(config, params)
    except ValueError as exc:  # e.g. --node-rank 1: other nodes run minisgl.tp.launch
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return _chat_loop(chat)
    finally:
        chat.close()


def _chat_loop(chat: ChatSession) -> int:
    tp = f", tp={chat.engine.tp.size}" if chat.engine.tp.size > 1 else ""
    print(f"minisgl shell ({chat.engine.resolved.path.name}, {chat.engine.device}{tp}). {HELP}")
    read = _line_reader()
    while True:
        try:
            line = read(PROMPT).strip()
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            continue
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            chat.reset()
            print("(conversation cleared)")
            continue
        if line.startswith("/"):
            print(HELP)
            continue
        try:
            chat.ask(line, _write)
        except ValueError as exc:
            print(f"error: {exc}")
        print()
