"""The staging ring on the GPU (run through the device tool: `python -m pytest tests/gpu -m gpu`):
with the device asleep, a ring of 2 pinned buffers stages 6 distinct steps' arrays; a slot
is rewritten only after the copy that read it has run, so every device tensor holds its own
input (SGLang #103: a plan buffer overwritten while an earlier async copy still read it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minisgl.kernels.staging import DeviceStager, Segment

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_ring_reuse_waits_while_the_device_lags() -> None:
    dev = torch.device("cuda")
    stager = DeviceStager(dev, ring=2)
    # Warm-up: both slots' pinned buffers exist, so no allocation falls in the window below.
    for _ in range(2):
        stager.stage([[0]], torch.int64)
    torch.cuda.synchronize()
    inputs: list[list[Segment]] = [
        [np.arange(1000 * i, 1000 * i + 37 + i), np.full(5 + 3 * i, -i), [i, i + 1]]
        for i in range(6)
    ]
    outs = []
    torch.cuda._sleep(10**7)  # the device is busy: the stagings' copies queue behind it
    for i, segments in enumerate(inputs):
        outs.append(stager.stage(segments, torch.int64))
        if i == 1:
            # Both slots are read by copies that have not run yet: reusing one must wait.
            assert not any(event.query() for _, event in stager._ring if event is not None)
    torch.cuda.synchronize()
    for i, (segments, views) in enumerate(zip(inputs, outs)):
        for seg, view in zip(segments, views):
            assert view.device.type == "cuda"
            assert view.cpu().tolist() == np.asarray(seg).tolist(), i
