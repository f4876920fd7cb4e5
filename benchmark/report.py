"""What every benchmark script does with its result: print it and append it as a JSON line."""

from __future__ import annotations

import json
import subprocess
from typing import Any


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
