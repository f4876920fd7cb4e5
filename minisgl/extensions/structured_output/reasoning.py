"""Reasoning models: the chat reply's thinking, split off into ``reasoning_content``
(``--reasoning-parser``; a request opts out with ``separate_reasoning: false``).

- ``qwen3``: thinking is a leading ``<think>...</think>`` block (with ``enable_thinking:
  false`` Qwen3's template closes an empty block in the prompt, and the reply has none).
- ``deepseek-r1``: the template opens ``<think>`` in the prompt, so the reply starts inside
  the thinking and leaves it at ``</think>`` (a reply cut off before that is all thinking).

The text after ``</think>`` (leading newlines dropped) is the content, which tool-call parsing
then sees. A grammar (response_format, ...) waits for ``</think>`` unless thinking is off: the
chat hook sets ``grammar_after`` (chat.py; the scheduler's side is grammar.py).
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek-r1")


def split_reasoning(text: str, parser: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a complete reply."""
    stream = StreamingReasoningParser(parser)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    reasoning += more_reasoning
    content += more_content
    return (reasoning if stream.saw_reasoning else None), content


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class StreamingReasoningParser:
    """Per streamed choice: ``feed`` returns (reasoning delta, content delta); text that may
    be the start of a tag is held back until the next piece (or ``finish``) decides it."""

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(PARSERS)}")
        # "start": not yet known whether the reply opens with <think> (qwen3 only).
        self.mode = "reasoning" if parser == "deepseek-r1" else "start"
        self.saw_reasoning = self.mode == "reasoning"
        self.held = ""
        self.trim_newlines = False  # drop newlines at the start of the content
        self.fresh = True  # nothing of the reasoning seen yet

    def feed(self, delta: str) -> tuple[str, str]:
        buf, self.held = self.held + delta, ""
        reasoning = content = ""
        if self.mode == "start":
            stripped = buf.lstrip()
            if stripped.startswith(START):
                self.mode, self.saw_reasoning = "reasoning", True
                buf = stripped[len(START) :]
            elif START.startswith(stripped):  # still possibly "<think>": wait for more
                self.held = buf
                return "", ""
            else:
                self.mode = "content"
        if self.mode == "reasoning":
            if self.fresh:  # a deepseek-r1 reply may still open with the tag itself
                stripped = buf.lstrip()
                if START.startswith(stripped) and len(stripped) < len(START):
                    self.held = buf
                    return "", ""
                if stripped.startswith(START):
                    buf = stripped[len(START) :]
                self.fresh = False
            at = buf.find(END)
            if at < 0:
                keep = partial_suffix(buf, END)
                self.held = buf[len(buf) - keep :]
                return buf[: len(buf) - keep], ""
            reasoning, buf = buf[:at], buf[at + len(END) :]
            self.mode, self.trim_newlines = "content", True
        if self.trim_newlines:
            buf = buf.lstrip("\n")
            self.trim_newlines = not buf
        content = buf
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) still held once the reply is complete."""
        held, self.held = self.held, ""
        if self.mode == "reasoning":
            return held, ""
        return "", held
