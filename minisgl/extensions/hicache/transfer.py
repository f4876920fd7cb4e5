"""A Triton kernel that copies whole KV pages between the device pool and pinned host
memory, run by the GPU on both sides.

Pinned host memory is mapped into the device's address space (unified addressing), so a
kernel can read and write it directly over PCIe. The GPU then gathers and scatters the
pages itself: no host thread copies bytes into staging first, which capped HiCache's
loads at the host's memcpy speed (benchmark/RESULTS.md, "HiCache").

Both sides are seen as [layers, 2 (K, V), pages, words] views with their own strides; one
program copies one chunk of one page of one (layer, K or V).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels import cdiv

_BLOCK = 1024  # words per program


@triton.jit
def _copy_pages_kernel(
    src,
    dst,
    src_pages,
    dst_pages,
    words,
    src_layer,
    src_side,
    src_page,
    dst_layer,
    dst_side,
    dst_page,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    layer, side = tl.program_id(1) // 2, tl.program_id(1) % 2
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < words
    s = tl.load(src_pages + i).to(tl.int64)
    d = tl.load(dst_pages + i).to(tl.int64)
    src_at = layer.to(tl.int64) * src_layer + side * src_side + s * src_page
    dst_at = layer.to(tl.int64) * dst_layer + side * dst_side + d * dst_page
    tl.store(dst + dst_at + offs, tl.load(src + src_at + offs, mask=mask), mask=mask)


def copy_pages(
    src: torch.Tensor, src_pages: torch.Tensor, dst: torch.Tensor, dst_pages: torch.Tensor
) -> None:
    """dst[:, :, dst_pages[i]] = src[:, :, src_pages[i]] for [layers, 2, pages, words] views
    (the last dim contiguous; either side may be pinned host memory), on the current
    stream. The page ids are int64 on the device."""
    assert src.shape[:2] == dst.shape[:2] and src.shape[3] == dst.shape[3]
    assert src.dtype == dst.dtype and src.stride(3) == 1 and dst.stride(3) == 1
    n, layers, width = src_pages.numel(), src.shape[0], src.shape[3]
    if n == 0:
        return
    grid = (n, layers * 2, cdiv(width, _BLOCK))
    _copy_pages_kernel[grid](
        src,
        dst,
        src_pages,
        dst_pages,
        width,
        *src.stride()[:3],
        *dst.stride()[:3],
        BLOCK=_BLOCK,
    )
