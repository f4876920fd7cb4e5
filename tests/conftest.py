from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def assert_engine_clean(llm: object) -> None:
    """After a run: integrity holds, nothing is running, every page is free or evictable."""
    sched = llm.scheduler  # type: ignore[attr-defined]
    sched.check_integrity()
    assert not sched.running and not sched.waiting
    kv = sched.kv
    assert kv.allocator.num_free_pages + kv.cache.evictable_pages == kv.allocator.num_pages
    assert kv.cache.protected_pages == 0


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.helpers import make_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return {a: make_tiny_model(root / a, a) for a in ("llama", "mistral", "qwen2", "qwen3")}
