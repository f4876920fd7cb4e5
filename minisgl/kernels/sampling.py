"""The sampler's exponential race as Triton kernels (CUDA).

Same draw as ``minisgl.engine.noise.race``: argmax_j(scores[b, j] - log E[b, j]) with
E = -log1p(-u), u = hash(seed, step, id) / 2^32, the same splitmix64 hash bit for bit (the
float logs may round a few ulps apart from torch's, so rare near-ties can pick differently). Eager
torch needs ~20 passes over [B, V] for it; this is one, with no compilation at run time and no
guards to check per call (torch.compile's cost on the host every step).

The race is split over the vocabulary, since one program per row leaves most SMs idle at
decode batch sizes: a grid of (rows, chunks) programs each scans a chunk of 1, 2 or 4 blocks of
2048 columns (smaller chunks for fewer rows, so even a few rows make ~1024 programs), keeps a
running best per lane, and writes its chunk's (value, column) to a [rows, chunks] scratch; a
second kernel, one program per row, reduces over the chunks. Ties go to the smallest column at
every level, so the winner is the first maximum, as torch.argmax's.

`triton_sample` is the sampler's common case in that one pass: it reads the logits in the
model's dtype (upcast to float32 in registers, exact), divides by each row's temperature
(IEEE-rounded, as torch's ``x / t``) and takes rows with temperature 0 as greedy (their raw
argmax, no noise, no hashing). `triton_race` runs the same kernels on scores already scaled
and filtered (the top-k path), optionally with the vocabulary ids of its columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.pdl import pdl_args, pdl_wait

_BLOCK = 2048
_MAX_BLOCKS_PER_CHUNK = 4
# Programs worth launching before chunks shrink: a few waves of 2-3 resident 8-warp programs
# on each of an H200's 132 SMs, so the last wave's tail is a small share of the time.
_MIN_PROGRAMS = 1024


@triton.jit
def _mix64(z):
    # splitmix64 finaliser on uint64 (shifts are logical, products wrap mod 2^64).
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _log1p(x):
    # Kahan's log1p: exact where 1 + x rounds to 1, a few ulps elsewhere. The winners of the
    # race are the smallest E = -log1p(-u), so small u must not collapse to log(1) = 0.
    y = 1.0 + x
    return tl.where(y == 1.0, x, tl.log(y) * (x / (y - 1.0)))


@triton.jit
def _log_exp(z):
    # log E for the splitmix64 state z = key + (id + 1) * gamma: u = (low 32 bits, forced odd)
    # / 2^32. The hash is below 2^32, so converting it from uint32 rounds as from uint64.
    h = ((_mix64(z) & 0xFFFFFFFF) | 1).to(tl.uint32)
    neg_u = h.to(tl.float32) * -2.3283064365386963e-10  # -(2^-32)
    return tl.log(-_log1p(neg_u))


# n_cols and chunk_cols stay specialised: known divisible by 16 (any common vocab size), the
# masked loads vectorise to 16 bytes per thread.
@triton.jit(do_not_specialize=["n_chunks"])
def _race_chunk_kernel(
    scores_ptr, ids_ptr, temps_ptr, seeds_ptr, steps_ptr, best_ptr, arg_ptr,
    n_cols, chunk_cols, n_chunks, stride_s, stride_i,
    HAS_IDS: tl.constexpr, HAS_TEMPS: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    gamma = 0x9E3779B97F4A7C15
    seed = tl.load(seeds_ptr + row).to(tl.uint64)
    step = tl.load(steps_ptr + row).to(tl.uint64)
    key = _mix64(_mix64(seed) + (step + 1) * gamma)
    if HAS_TEMPS:
        temp = tl.load(temps_ptr + row)
        noisy = temp != 0.0  # temperature 0: a greedy row, the plain argmax
    else:
        temp = 1.0
        noisy = True
    lane = tl.arange(0, BLOCK)
    begin = chunk * chunk_cols
    # Column c hashes key + (c + 1) * gamma = (key + (start + 1) * gamma) + lane * gamma mod
    # 2^64: one 64-bit add per element instead of a 64-bit product.
    lane_gamma = lane.to(tl.uint64) * gamma
    block_gamma = tl.full([], BLOCK, tl.uint64) * gamma
    start_key = key + (begin + 1).to(tl.uint64) * gamma
    end = tl.minimum(begin + chunk_cols, n_cols)
    # Per lane, so one reduction per chunk rather than one per block; a lane sees its columns
    # in increasing order and strict > keeps the earlier of equal values.
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    arg = begin + lane
    for start in range(begin, end, BLOCK):
        offs = start + lane
        mask = offs < end
        s = tl.load(scores_ptr + row * stride_s + offs, mask=mask, other=float("-inf"))
        val = s.to(tl.float32)
        if noisy:  # uniform per program: greedy rows skip the hash entirely
            if HAS_TEMPS:
                val = tl.math.fdiv(val, temp, ieee_rounding=True)
            if HAS_IDS:
                vid = tl.load(ids_ptr + row * stride_i + offs, mask=mask, other=0).to(tl.uint64)
                z = key + (vid + 1) * gamma
            else:
                z = start_key + lane_gamma
            val = val - _log_exp(z)  # masked lanes stay -inf (E > 0, so log E > -inf)
        take = val > best
        best = tl.where(take, val, best)
        arg = tl.where(take, offs, arg)
        start_key += block_gamma
    top = tl.max(best, axis=0)
    # The smallest column holding the maximum; an all -inf chunk gives its first column.
    first = tl.min(tl.where(best == top, arg, n_cols), axis=0)
    tl.store(best_ptr + row * n_chunks + chunk, top)
    tl.store(arg_ptr + row * n_chunks + chunk, first.to(tl.int64))


@triton.jit(do_not_specialize=["n_chunks"])
def _race_reduce_kernel(
    best_ptr, arg_ptr, out_ptr, n_chunks, CHUNKS: tl.constexpr, PDL: tl.constexpr
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNKS)
    mask = offs < n_chunks
    best = tl.load(best_ptr + row * n_chunks + offs, mask=mask, other=float("-inf"))
    arg = tl.load(arg_ptr + row * n_chunks + offs, mask=mask, other=0x7FFFFFFFFFFFFFFF)
    top = tl.max(best, axis=0)
    # Chunks hold increasing columns: the smallest winning column is the first maximum.
    tl.store(out_ptr + row, tl.min(tl.where(best == top, arg, 0x7FFFFFFFFFFFFFFF), axis=0))


def _chunk_cols(rows: int, n: int) -> int:
    """Columns per program: the largest chunk (up to 4 blocks) that still gives the batch
    ``_MIN_PROGRAMS`` programs, else one block."""
    blocks = triton.cdiv(n, _BLOCK)
    per_chunk = _MAX_BLOCKS_PER_CHUNK
    while per_chunk > 1 and rows * triton.cdiv(blocks, per_chunk) < _MIN_PROGRAMS:
        per_chunk //= 2
    return per_chunk * _BLOCK


def _race(
    scores: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    ids: torch.Tensor | None,
    temps: torch.Tensor | None,
) -> torch.Tensor:
    if scores.stride(-1) != 1:
        scores = scores.contiguous()  # rows may be strided (a vocab-padded LM head's slice)
    rows, n = scores.shape
    out = torch.empty(rows, dtype=torch.int64, device=scores.device)
    if rows == 0:
        return out
    chunk_cols = _chunk_cols(rows, n)
    n_chunks = triton.cdiv(n, chunk_cols)
    best = torch.empty(rows, n_chunks, dtype=torch.float32, device=scores.device)
    # With one chunk the chunk kernel's column is the answer: no second launch.
    arg = out.view(rows, 1) if n_chunks == 1 else torch.empty_like(best, dtype=torch.int64)
    if ids is not None:
        ids = ids.contiguous()
    _race_chunk_kernel[(rows, n_chunks)](
        scores, scores if ids is None else ids, seeds if temps is None else temps, seeds, steps,
        best, arg, n, chunk_cols, n_chunks, scores.stride(0), 0 if ids is None else ids.stride(0),
        HAS_IDS=ids is not None, HAS_TEMPS=temps is not None, BLOCK=_BLOCK, num_warps=8, **pdl_args(),
    )  # fmt: skip
    if n_chunks > 1:
        # CHUNKS from the most chunks this width can have (one block each), not from this
        # batch's count: one compiled variant per vocabulary, none while serving.
        most = triton.next_power_of_2(triton.cdiv(n, _BLOCK))
        _race_reduce_kernel[(rows,)](
            best,
            arg,
            out,
            n_chunks,
            CHUNKS=most,
            num_warps=1,
            **pdl_args(),
        )
    return out


def triton_race(
    scores: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Index j of the winner per row of ``scores`` [B, N]; ``ids`` [N] (vocabulary ids in
    order: ``arange``) or [B, N] (the ids of a top-k's columns)."""
    return _race(scores, seeds, steps, ids if ids.dim() == 2 else None, None)


def triton_sample(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """One token per row of ``logits`` [B, V] (any float dtype): the race on logits / T for
    rows with T = ``temperatures[b]`` > 0, the argmax of the raw logits for rows with T = 0.
    The same tokens as ``race(x / T, ...)`` with greedy rows replaced by ``x.argmax(-1)``,
    x = ``logits.float()``."""
    return _race(logits, seeds, steps, None, temperatures)
