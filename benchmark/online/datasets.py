"""Workloads (what to send) and arrival schedules (when to send it).

Prompts are built as token ids; a backend that needs text renders them with a tokenizer (or,
without one, maps each id to a common English word, about one token in most vocabularies).
Building ids first keeps prefix structure exact: requests that share a prefix share its ids.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Ids below this are special tokens (BOS/EOS/PAD...) in the usual vocabularies; random prompts
# avoid them so a prompt never ends early or trips a chat template.
MIN_TOKEN_ID = 100


@dataclass
class BenchRequest:
    """One request: ``prefix`` is shared with other requests (a system prompt), ``body`` is
    its own; ``arrival`` (seconds from the start) is set by trace datasets only."""

    body: list[int]
    output_len: int
    prefix: list[int] = field(default_factory=list)
    arrival: float | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prefix) + len(self.body)


def parse_range(text: str) -> tuple[int, int]:
    """``"128"`` -> (128, 128); ``"64:256"`` or ``"64-256"`` -> (64, 256), inclusive."""
    sep = ":" if ":" in text else ("-" if "-" in text.strip("-") else None)
    if sep is None:
        n = int(text)
        return n, n
    lo, hi = (int(x) for x in text.split(sep, 1))
    if lo > hi or lo < 1:
        raise ValueError(f"bad length range {text!r}: need 1 <= MIN <= MAX")
    return lo, hi


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    lo = MIN_TOKEN_ID if vocab > 2 * MIN_TOKEN_ID else 3
    return [rng.randrange(lo, vocab) for _ in range(n)]


def random_requests(
    num: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int
) -> list[BenchRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n_in = rng.randint(*input_len)
        out.append(BenchRequest(random_ids(rng, n_in, vocab), rng.randint(*output_len)))
    return out


def shared_prefix_requests(
    groups: int, per_group: int, prefix_len: int, question_len: int, output_len: int,
    vocab: int, seed: int,
) -> list[BenchRequest]:  # fmt: skip
    """G groups x R requests: each group has its own P-token system prompt, each request its
    own Q-token question; sent group by group (as SGLang's generated-shared-prefix does)."""
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        prefix = random_ids(rng, prefix_len, vocab)
        for _ in range(per_group):
            out.append(
                BenchRequest(random_ids(rng, question_len, vocab), output_len, prefix=prefix)
            )
    return out


# Trace formats: Mooncake rows carry integer millisecond timestamps and hash ids of 512-token
# blocks; the Qwen (Bailian) traces carry float seconds and 16-token blocks.
TRACE_FORMATS: dict[str, tuple[float, int]] = {"mooncake": (1e-3, 512), "qwen": (1.0, 16)}


def detect_trace_format(rows: list[dict[str, Any]]) -> str:
    if all(isinstance(r.get("timestamp", 0), int) for r in rows):
        return "mooncake"
    return "qwen"


def load_trace_rows(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    rows = []
    with open(path) as fh:
        for line in fh:
            if line.strip():
                rows.append(json.loads(line))
                if limit is not None and len(rows) >= limit:
                    break
    return rows


def trace_requests(
    rows: list[dict[str, Any]], vocab: int, seed: int, fmt: str = "auto",
    block_size: int | None = None, time_scale: float = 1.0,
) -> list[BenchRequest]:  # fmt: skip
    """Replay trace rows: arrival = (timestamp - first) x unit x ``time_scale``. Prompts are
    rebuilt from ``hash_ids``: the same hash id is the same block of ids in every request, so
    the trace's prefix reuse reaches the server's cache; rows without hash ids get fresh ids."""
    if fmt == "auto":
        fmt = detect_trace_format(rows)
    unit, default_block = TRACE_FORMATS[fmt]
    block = block_size or default_block
    rng = random.Random(seed)
    blocks: dict[int, list[int]] = {}
    t0 = min((float(r.get("timestamp", 0)) for r in rows), default=0.0)
    out = []
    for row in rows:
        n_in, n_out = int(row["input_length"]), int(row["output_length"])
        ids: list[int] = []
        for h in row.get("hash_ids") or []:
            if len(ids) >= n_in:
                break
            if h not in blocks:
                blocks[h] = random_ids(random.Random(f"{seed}:{h}"), block, vocab)
            ids += blocks[h]
        ids = ids[:n_in] + random_ids(rng, max(0, n_in - len(ids)), vocab)
        arrival = (float(row.get("timestamp", t0)) - t0) * unit * time_scale
        out.append(BenchRequest(ids, max(1, n_out), arrival=arrival))
    return out


def arrival_times(n: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Send offsets (seconds from the start) of ``n`` requests at ``rate`` per second: gaps are
    gamma-distributed with shape ``burstiness`` and mean 1/rate (1.0 = Poisson arrivals,
    exponential gaps); ``rate`` inf sends everything at once."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    return out


# Fallback renderer: common words that are a single token in most BPE vocabularies.
WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which "
    "she do how their if will up other about out many then them these so some her would make "
    "like him into time has look two more write go see number no way could people my than "
    "first water been call who oil its now find long down day did get come made may part"
).split()


class Renderer:
    """Turns token ids into prompt text: ``tokenizer.decode`` when a tokenizer is given, else
    one word per id (deterministic, so shared ids still render to shared text)."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def __call__(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self.tokenizer is not None:
            return str(self.tokenizer.decode(ids, skip_special_tokens=True))
        return " " + " ".join(WORDS[i % len(WORDS)] for i in ids)


def load_tokenizer(name: str) -> Any:
    """A Hugging Face tokenizer; through minisgl's resolver when available, so a GGUF file or
    the bundled default model (``default``) works too."""
    try:
        from minisgl.models.resolve import resolve_model_path
        from minisgl.tokenizer import load_tokenizer as minisgl_tokenizer
    except ImportError:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)
    return minisgl_tokenizer(resolve_model_path(None if name == "default" else name))
