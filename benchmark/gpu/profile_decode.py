"""GPU diagnostics: decode-attention bandwidth and a kernel-time breakdown of the offline run.

python benchmark/gpu/profile_decode.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def attention_bandwidth() -> None:
    import triton.testing

    from minisgl.attention.base import BatchLayout
    from minisgl.attention.triton_backend import TritonBackend
    from minisgl.kvcache.pool import KVPool

    for bsz, seq in ((256, 1024), (64, 4096), (1, 4096)):
        hq, hk, d = 16, 8, 128
        pool = KVPool(1, bsz * seq + 1, 1, hk, d, torch.bfloat16, torch.device("cuda"))
        pool.buffer.normal_()
        table = torch.randperm(bsz * seq, device="cuda").view(bsz, seq)
        backend = TritonBackend(pool)
        layout = BatchLayout(list(range(bsz)), [seq - 1] * bsz, [1] * bsz, table)
        md = backend.prepare(layout, torch.device("cuda"))
        q = torch.randn(bsz, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(bsz, hk, d, device="cuda", dtype=torch.bfloat16)
        slots = table[:, -1].contiguous()

        def run(backend=backend, q=q, k=k, slots=slots, md=md, d=d) -> None:  # type: ignore[no-untyped-def]
            backend.forward(q, k, k, 0, slots, md, d**-0.5)

        ms = triton.testing.do_bench(run)
        gb = bsz * seq * hk * d * 2 * 2 / 1e9
        print(
            f"decode attn B={bsz} seq={seq}: {ms * 1000:.1f} us, {gb / ms:.0f} TB/s*1e-3 -> {gb / ms:.0f} GB/ms (KV {gb:.2f} GB)"
        )


def offline_profile() -> None:
    from torch.profiler import ProfilerActivity, profile

    from benchmark.offline.bench import workload
    from minisgl import LLM, SamplingParams

    llm = LLM(
        "benchmark/configs/Qwen3-0.6B",
        load_format="dummy",
        context_length=4096,
        chunked_prefill_size=16384,
        cuda_graph_max_bs=256,
    )
    prompts, mt = workload(256, 0.5, 10000)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in mt]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)
    s = llm.scheduler
    for p, sp in zip(prompts, params):
        s.add_request(p, sp)
    for _ in range(60):
        s.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(40):
            s.step()
        torch.cuda.synchronize()
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
    )
    print(
        prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60)
    )
    while s.has_work:
        s.step()


if __name__ == "__main__":
    attention_bandwidth()
    offline_profile()
