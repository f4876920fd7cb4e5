"""Aborts under overlap scheduling and CUDA graphs with a device that lags the host (run
through the device tool: `python -m pytest tests/gpu/test_abort_overlap_gpu.py -m gpu`).

Every forward first launches a gate kernel that spins on the device until the host opens it,
and the host opens a step's gate only when it waits for that step's results (the next
``step()``): each step's batch is therefore still running when the host returns from
``step()`` and aborts, whatever the timing (a timed device sleep, as before, lost that race
once the host was slower than the sleep). Long decodes run beside
a short prompt repeated with max_tokens 1-2 (finished in their first steps); every third
request is aborted at a varied point: waiting, mid-decode, and right after its last token
was launched (the finishing step: SGLang PR #111, a request freed twice; #58, an illegal
memory access when the device lags the host). Survivors' greedy tokens must equal an eager
no-overlap run of the same requests (aborted at the same points) and nothing may leak.
tests/unit/scheduler/test_abort_mix.py runs the same driver on the CPU.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.engine.step import PendingStep
from tests.helpers import assert_engine_clean, make_tiny_model
from tests.workloads import ABORT_AT, check_abort_mix, run_abort_mix

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# A gate left shut (a host wait this test did not foresee) opens by itself after this many
# polls (about a second or more), so a wrong guess costs time and fails the check instead
# of hanging the GPU.
MAX_POLLS = 2 * 10**6


@functools.cache
def _gate_kernel() -> Any:
    """The spinning kernel (triton imported here: a CPU run's collection must not import it
    before the interpreter tests can ask for the interpreter)."""
    import triton
    import triton.language as tl

    @triton.jit
    def gate(gate_ptr, ticket, MAX: tl.constexpr):
        polls = 0
        while (tl.load(gate_ptr, volatile=True) < ticket) & (polls < MAX):
            polls += 1

    return gate


class DeviceGate:
    """Launch n waits on the device until the host has opened ticket n. The host writes the
    open ticket from pinned memory on a side stream, which runs beside the spinning kernel."""

    def __init__(self) -> None:
        self.device_value = torch.zeros(1, dtype=torch.int64, device="cuda")
        self.host_value = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self.side = torch.cuda.Stream()
        self.launched = 0
        self.opened = 0

    def close_next(self) -> int:
        """Queue a gate on the current stream; its ticket."""
        self.launched += 1
        _gate_kernel()[(1,)](self.device_value, self.launched, MAX=MAX_POLLS)
        return self.launched

    def open(self, ticket: int) -> None:
        if ticket <= self.opened:
            return
        self.opened = ticket
        with torch.cuda.stream(self.side):
            self.side.synchronize()  # the last write from the pinned value has been read
            self.host_value[0] = ticket
            self.device_value.copy_(self.host_value, non_blocking=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 64: FlashInfer's prefill kernels have no configuration for the default 32.
    return make_tiny_model(
        tmp_path_factory.mktemp("abort") / "qwen3",
        "qwen3",
        max_position_embeddings=2048,
        head_dim=64,
    )


def _lag_device(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> DeviceGate:
    """Test-local: every forward (eager or graph replay) first launches a gate; waiting for
    a step's results (its one host sync) opens the gates up to that step's."""
    engine, gate = llm.engine, DeviceGate()
    run_model, forward = engine.run_model, engine.forward
    tickets: dict[int, int] = {}

    def lagging(*args: Any, **kwargs: Any) -> torch.Tensor:
        gate.close_next()
        return run_model(*args, **kwargs)

    def launch(*args: Any, **kwargs: Any) -> PendingStep | None:
        pending = forward(*args, **kwargs)
        if pending is not None:
            tickets[id(pending)] = gate.launched
        return pending

    def result(pending: PendingStep) -> Any:
        gate.open(tickets.pop(id(pending), gate.launched))
        return wait(pending)

    wait = PendingStep.result
    monkeypatch.setattr(engine, "run_model", lagging)
    monkeypatch.setattr(engine, "forward", launch)
    monkeypatch.setattr(PendingStep, "result", result)
    return gate


def _device_busy(llm: LLM) -> bool:
    """The batch in flight has not finished on the device yet."""
    batch = llm.scheduler.inflight
    event = batch.pending.event if batch is not None and batch.pending is not None else None
    return event is not None and not event.query()


@pytest.mark.parametrize("backend", ["triton", "torch", "flashinfer"])
def test_aborts_under_overlap_graphs_and_a_lagging_device(
    tiny: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    # FlashInfer needs 16-bit; the others run fp32, where greedy ties are implausible.
    dtype = "bfloat16" if backend == "flashinfer" else "float32"
    opts: dict[str, Any] = dict(dtype=dtype, attention_backend=backend, chunked_prefill_size=64)

    base = LLM(str(tiny), cuda_graph_max_bs=0, disable_overlap_scheduling=True, **opts)
    assert not base.scheduler.overlap
    ref, ref_aborted = run_abort_mix(base)
    check_abort_mix(ref, ref_aborted, ref, overlap=False)
    assert_engine_clean(base)
    base.close()

    llm = LLM(str(tiny), **opts)
    assert llm.scheduler.overlap
    runner = llm.engine.graph_runner
    # CUDA graphs are captured for the triton backend only (the others run eagerly).
    assert (runner is not None) == (backend == "triton")
    gate = _lag_device(llm, monkeypatch)
    busy: dict[int, bool] = {}

    def before_abort(req: Any) -> None:
        busy[req.uid] = _device_busy(llm)

    reqs, aborted = run_abort_mix(llm, before_abort)
    check_abort_mix(reqs, aborted, ref, overlap=True)
    # Each finishing-step abort came while its last token's batch still ran on the device.
    for i, at in ABORT_AT.items():
        if at == "last":
            assert busy[reqs[i].uid], (i, busy)
    if runner is not None:
        assert runner.replays["decode"] > 0, runner.replays
    gate.open(gate.launched)
    torch.cuda.synchronize()  # any fault of the lagging batches surfaces here
    assert_engine_clean(llm)
    # The engine keeps serving after the aborts.
    two = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    assert llm.generate([ref[1].prompt_ids], two)[0]["token_ids"] == ref[3].output_ids
    assert_engine_clean(llm)
