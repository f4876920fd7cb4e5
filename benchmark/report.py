"""What the benchmark scripts share: ``--engine-arg`` options for LLM(...), and printing a
result as a JSON line (appended to a file if asked)."""

from __future__ import annotations

import argparse
import json
import subprocess
from typing import Any


def add_engine_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--engine-arg", action="append", default=[], help="KEY=VALUE option for LLM(...)"
    )


def engine_options(pairs: list[str], **defaults: object) -> dict[str, object]:
    """``defaults`` overridden by the KEY=VALUE pairs; values that are JSON (numbers,
    true/false/null, lists, objects) are parsed, anything else stays a string (so
    ``attention_backend=flashinfer`` is a name, not a malformed ``false``)."""
    options = dict(defaults)
    for kv in pairs:
        key, value = kv.split("=", 1)
        try:
            parsed: object = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        options[key.replace("-", "_")] = parsed
    return options


def commit() -> str:
    """The short hash of HEAD (for RESULTS.md), or "unknown" outside a git checkout."""
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def emit(result: dict[str, Any], output: str | None) -> None:
    """Print ``result`` as one JSON line, and append that line to ``output`` if given."""
    line = json.dumps(result)
    print(line)
    if output:
        with open(output, "a") as f:
            f.write(line + "\n")
