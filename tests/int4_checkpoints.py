"""Write GPTQ- and AWQ-format 4-bit checkpoints of a float tiny model, for the tests.

A packer of our own, following the published formats (AutoGPTQ's v1 export and AutoAWQ's
GEMM export), written independently of minisgl/extensions/quantization/int4.py so that the loader is
checked against the format, not against itself. Each call also writes the reference: the
same model with every quantized weight replaced by its dequantized value, as a plain float
checkpoint that Hugging Face transformers (and our engine) load as usual.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a word holds column 8c + order[i]
_LINEAR = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) -> the int32 tensor with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_gptq_qweight(q_kn: torch.Tensor) -> torch.Tensor:
    """codes [K, N] -> int32 [K/8, N]; word r of column n holds inputs 8r..8r+7, input
    8r + j in bits 4j..4j+3 (AutoGPTQ's pack)."""
    k, n = q_kn.shape
    words = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(8):
        words |= q_kn[j::8].to(torch.int64) << (4 * j)
    return to_int32(words)


def pack_along_n(vals: torch.Tensor, order: list[int]) -> torch.Tensor:
    """[R, N] -> int32 [R, N/8]; nibble i of word c holds column 8c + order[i]."""
    r, n = vals.shape
    words = torch.zeros(r, n // 8, dtype=torch.int64)
    for i in range(8):
        words |= vals[:, order[i] :: 8].to(torch.int64) << (4 * i)
    return to_int32(words)


def quantize_weight(
    w: torch.Tensor, group: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group of ``group`` inputs: codes [K, N], zeros and fp16 scales
    [K/G, N]. Zero points lie in 1..15: GPTQ v1 stores zero - 1, whose 0 would wrap."""
    n, k = w.shape
    wg = w.t().reshape(k // group, group, n).float()
    lo, hi = wg.amin(1), wg.amax(1)
    scales = ((hi - lo) / 15).clamp_min(1e-4).half()
    zeros = torch.round(-lo / scales.float()).clamp(1, 15).to(torch.int64)
    codes = torch.round(wg / scales.float()[:, None] + zeros[:, None]).clamp(0, 15)
    # A few random codes too, so the nibble positions all see varied values.
    noise = torch.randint(0, 16, codes.shape, generator=gen)
    codes = torch.where(torch.rand(codes.shape, generator=gen) < 0.1, noise, codes)
    return codes.to(torch.int64).reshape(k, n), zeros, scales


def dequantize_reference(
    codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int
) -> torch.Tensor:
    """W [N, K] float32 from codes [K, N] and zeros/scales [K/G, N]."""
    z = zeros.repeat_interleave(group, 0).float()
    s = scales.repeat_interleave(group, 0).float()
    return ((codes.float() - z) * s).t().contiguous()


def write_quantized(
    src: Path, dst_quant: Path, dst_ref: Path, method: str, group_size: int = 32, seed: int = 0
) -> tuple[Path, Path]:
    """From the float model at ``src``: a ``method`` ("gptq" or "awq") checkpoint at
    ``dst_quant`` and its dequantized float twin at ``dst_ref``."""
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    weights = load_file(str(src / "model.safetensors"))
    quant: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if not _LINEAR.search(name):
            quant[name] = ref[name] = w
            continue
        k = w.shape[1]
        group = k if group_size == -1 else group_size
        codes, zeros, scales = quantize_weight(w, group, gen)
        ref[name] = dequantize_reference(codes, zeros, scales, group)
        base = name.removesuffix(".weight")
        if method == "gptq":
            quant[base + ".qweight"] = pack_gptq_qweight(codes)
            quant[base + ".qzeros"] = pack_along_n(zeros - 1, list(range(8)))
            quant[base + ".g_idx"] = torch.arange(k, dtype=torch.int32) // group
        else:
            quant[base + ".qweight"] = pack_along_n(codes, AWQ_PACK_ORDER)
            quant[base + ".qzeros"] = pack_along_n(zeros, AWQ_PACK_ORDER)
        quant[base + ".scales"] = scales
    for dst, tensors in ((dst_quant, quant), (dst_ref, ref)):
        shutil.copytree(src, dst)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    if method == "gptq":
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False,
              "sym": False, "checkpoint_format": "gptq"}  # fmt: skip
    else:
        qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
              "version": "gemm"}  # fmt: skip
    cfg["quantization_config"] = qc
    (dst_quant / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst_quant, dst_ref
