"""All-reduce latency on two GPUs, inside CUDA graphs (as decode runs it): NCCL vs the
peer-memory one-shot kernel (minisgl/extensions/peer_memory/peer_all_reduce.py), per
message size, and whether the two sums are bit-identical.

    python benchmark/gpu/bench_all_reduce.py [--sizes 4096 65536 1048576]

Sizes are bf16 elements per message (Qwen3-8B at batch 1: 4,096). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ITERS = 100  # all-reduces per captured graph
REPLAYS = 20


def graph_us(fn: object, x: torch.Tensor) -> float:
    """Mean microseconds per call of ``fn(x)``, ITERS calls captured in one graph. Both
    ranks run exactly the same sequence (a collective must not be timed adaptively)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(x)  # type: ignore[operator]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(ITERS):
                fn(x)  # type: ignore[operator]
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * ITERS)


def worker(rank: int, init_file: str, sizes: list[int], out: str) -> None:
    from minisgl.distributed.reducer import all_ranks_agree
    from minisgl.extensions.peer_memory.peer_all_reduce import open_reducer

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2)
    dev = torch.device("cuda", rank)
    peer = open_reducer(dev, (torch.bfloat16,))
    if not all_ranks_agree(peer is not None, dev):  # as setup_reducer does
        peer = None
    rows = []
    for n in sizes:
        gen = torch.Generator(device=dev).manual_seed(1000 * rank + n)
        x = torch.randn(n, device=dev, dtype=torch.bfloat16, generator=gen)
        ref = x.clone()
        dist.all_reduce(ref)
        row: dict[str, object] = {"elements": n, "bytes": 2 * n}

        def nccl(t: torch.Tensor) -> None:
            dist.all_reduce(t)

        row["nccl_us"] = round(graph_us(nccl, x.clone()), 2)
        if peer is not None and peer.takes(x):
            row["peer_equal"] = bool(torch.equal(peer(x), ref))
            row["peer_us"] = round(graph_us(peer, x), 2)
        rows.append(row)
    if rank == 0:
        Path(out).write_text(
            json.dumps({"bench": "all_reduce_tp2", "peer": peer is not None, "sizes": rows})
        )
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 65536, 262144, 1048576])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out = os.path.join(tmp, "init"), os.path.join(tmp, "out.json")
        mp.spawn(worker, args=(init_file, args.sizes, out), nprocs=2, join=True)
        print(Path(out).read_text())


if __name__ == "__main__":
    main()
