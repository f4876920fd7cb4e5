"""HiCache's page-copy kernel (transfer.py) against indexing in torch, through the strided
views the host tier uses on both sides: the host's page-major rows and the device pool's
K/V-major layout. Checks run under Triton's interpreter on the CPU (tests/kernel_checks.py)
and natively under the ``gpu`` marker, where the host side is pinned memory the kernel
reads and writes directly."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # the interpreter child: make `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from minisgl.extensions.hicache.host_tier import words
from tests import kernel_checks  # noqa: E402

LAYERS, HOST_PAGES, DEVICE_PAGES = 3, 9, 7


def _views(device: torch.device, half_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(host [layers, 2, pages, words] over page-major rows, device pool the same over a
    [2, layers, pages, bytes] buffer), filled with distinct random bytes."""
    g = torch.Generator().manual_seed(half_bytes)
    rows = torch.randint(0, 256, (LAYERS, HOST_PAGES, 2 * half_bytes), generator=g)
    host = rows.to(torch.uint8)
    if device.type == "cuda":
        host = host.pin_memory()
    pool = torch.randint(0, 256, (2, LAYERS, DEVICE_PAGES, half_bytes), generator=g)
    pool = pool.to(torch.uint8).to(device)
    return host, pool


def _host_view(host: torch.Tensor) -> torch.Tensor:
    return words(host.view(LAYERS, HOST_PAGES, 2, -1).permute(0, 2, 1, 3))


def check_load_then_save_round_trip(device: torch.device) -> None:
    from minisgl.extensions.hicache.transfer import copy_pages

    for half_bytes in (4096, 36, 6):  # int64, int32 and byte words; 4096 spans 2 programs
        host, pool = _views(device, half_bytes)
        src = torch.tensor([4, 0, 8], dtype=torch.int64)
        dst = torch.tensor([6, 2, 3], dtype=torch.int64)
        want = pool.clone()
        halves = host.view(LAYERS, HOST_PAGES, 2, -1)
        for s, d in zip(src.tolist(), dst.tolist()):
            want[:, :, d] = halves[:, s].permute(1, 0, 2).to(device)
        device_view = words(pool.permute(1, 0, 2, 3))
        copy_pages(_host_view(host), src.to(device), device_view, dst.to(device))
        assert torch.equal(pool, want), f"load, {half_bytes} bytes"
        # Back to other host pages: each holds its device page's K then V.
        back = torch.tensor([1, 5, 7], dtype=torch.int64)
        copy_pages(device_view, dst.to(device), _host_view(host), back.to(device))
        if device.type == "cuda":
            torch.cuda.synchronize()
        for s, b in zip(src.tolist(), back.tolist()):
            assert torch.equal(host[:, b], host[:, s]), f"save, {half_bytes} bytes"


def check_one_layer_of_many(device: torch.device) -> None:
    """A load copies one layer (the tier's layer-by-layer loads): the others stay as they were."""
    from minisgl.extensions.hicache.transfer import copy_pages

    host, pool = _views(device, 64)
    before = pool.clone()
    src, dst = torch.tensor([2], device=device), torch.tensor([5], device=device)
    copy_pages(_host_view(host)[1:2], src, words(pool.permute(1, 0, 2, 3))[1:2], dst)
    changed = (pool != before).flatten(2).any(-1)  # [2, layers] x pages
    assert torch.equal(pool[:, 1, 5].cpu(), host[1, 2].view(2, -1))
    assert not torch.equal(pool[:, 1, 5], before[:, 1, 5])
    assert changed[:, 0].sum() == 0 and changed[:, 2].sum() == 0


CHECKS = kernel_checks.collect(globals())

test_interpreted, test_on_gpu = kernel_checks.make_tests(__file__, CHECKS)

if __name__ == "__main__":
    kernel_checks.main(CHECKS)
