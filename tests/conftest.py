from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers import TinyModels, assert_engine_clean  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist each worker, and each server or engine process it starts, computes
    on one thread: with two workers on the two-core CI machine, OpenMP threads that spin for
    a busy core slow a server's steps several times over."""
    if hasattr(config, "workerinput"):
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by every child process
        torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """For xdist's loadgroup: a whole file goes to one worker (its module fixtures start
    once), and the files that share the session's default-model server go together (it
    starts once). Those and the other end-to-end files are queued first, so that the last
    assignments, which decide when both workers are done, are short unit files."""
    shared = {item.path for item in items if "default_server" in item.fixturenames}

    def group(item: pytest.Item) -> str:
        return "default_server" if item.path in shared else str(item.path)

    items.sort(key=lambda item: (group(item) != "default_server", "e2e" not in item.path.parts))
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group(item)))


@pytest.fixture(autouse=True)
def _every_engine_ends_clean(monkeypatch: pytest.MonkeyPatch) -> object:
    """After every test that ran an engine in this process: integrity holds and every page
    is free or evictable (module-scoped engines are checked by the tests that use them)."""
    from minisgl import llm as llm_module

    # Weak references: tests that rely on garbage collection (TP shutdown) must still see it.
    created: list[weakref.ref[object]] = []
    original = llm_module.LLM.__init__

    def tracking_init(self: object, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)  # type: ignore[arg-type]
        created.append(weakref.ref(self))

    monkeypatch.setattr(llm_module.LLM, "__init__", tracking_init)
    yield
    for ref in created:
        llm = ref()
        if llm is None:
            continue
        sched = getattr(llm, "scheduler", None)
        if sched is None or getattr(sched, "inflight", None) is not None:
            continue  # a test that stopped mid-step on purpose
        if hasattr(sched, "_channel"):
            continue  # a TP mirror: tests/unit/tp checks every rank's integrity itself
        if sched.running or sched.waiting:
            continue  # a test that left requests queued on purpose checks them itself
        assert_engine_clean(llm)


@pytest.fixture
def short_dist_timeout() -> Iterator[None]:
    """Spawned ranks inherit it: a divergence between them fails in a minute instead of ten."""
    from minisgl import env

    with env.override({env.DIST_TIMEOUT_S: 60}):
        yield


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    """Every tiny random model a test asks for, built once per session (tests/helpers.py)."""
    return TinyModels(tmp_path_factory.mktemp("tiny"))
