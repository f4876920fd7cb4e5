from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.server_utils import (
    QUESTION,
    ServerHandle,
    assert_clean_log,
    pid_alive,
    start_server,
    wait_until,
)
from tests.helpers import TinyModels


@pytest.fixture(scope="session")
def default_server() -> Iterator[ServerHandle]:
    """The bundled SmolLM2-135M on CPU, started once and shared by the API test modules."""
    server = start_server(["--served-model-name", "smollm2"])
    status, body = server.post(
        "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 8, "temperature": 0}
    )
    assert status == 200, body
    server.notes["ready_s"] = server.ready_at - server.launched_at
    server.notes["first_answer_s"] = time.perf_counter() - server.launched_at
    server.notes["first_answer"] = body["choices"][0]["message"]["content"]
    yield server
    code = server.stop()
    assert code == 0, server.log()[-3000:]
    assert_clean_log(server)


@pytest.fixture(scope="session")
def tokenizer(default_server: ServerHandle) -> Any:
    """The default model's tokenizer, as ``load_tokenizer`` builds it from the GGUF file.

    Building it takes ~15 s of CPU, so load the copy the server's tokenizer worker saved
    (``save_pretrained`` of that same object) instead of converting the GGUF a third time."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_server.run_dir() / "tokenizer"))


@pytest.fixture(scope="session")
def tiny_model(tiny_models: TinyModels) -> Path:
    """The tiny random Llama the unit tests use too."""
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def tiny_long_model(tiny_models: TinyModels) -> Path:
    """The tiny model with an 8,192-token context: requests long enough to outlast a timeout,
    a shutdown grace period or a prefill window, however fast the machine is."""
    return tiny_models.build("llama", max_position_embeddings=8192)


@pytest.fixture(scope="session")
def tiny_server(tiny_model: Path) -> Iterator[ServerHandle]:
    """The tiny random model, for tests where speed matters. Stopping it checks the SIGTERM
    path: exit code 0, every child gone, the run directory removed."""
    server = start_server(["--model", str(tiny_model), "--served-model-name", "tiny"])
    pids = server.child_pids()
    assert set(pids) == {"scheduler-tp0", "tokenizer"}, server.log()
    yield server
    code = server.stop(signal.SIGTERM)
    assert code == 0, server.log()[-3000:]
    assert wait_until(lambda: not any(pid_alive(p) for p in pids.values()), 10)
    assert not server.run_dir().exists()
    assert_clean_log(server)
