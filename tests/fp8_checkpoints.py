"""Write FP8 checkpoints of a float tiny model, for the tests: Hugging Face ``fp8`` (block-wise
``weight_scale_inv``) and compressed-tensors ``float-quantized`` (``weight_scale`` per channel
or per tensor), dense and MoE (one tensor per expert, as the hub's checkpoints).

Written independently of minisgl/extensions/quantization/fp8.py, block by block, so that the
loader is checked against the format, not against itself. Each call also writes the twin: the
same model with every quantized weight replaced by its dequantized value (e4m3 value times
its scale, in float32), as a plain float checkpoint.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

E4M3 = torch.float8_e4m3fn
_LINEAR = re.compile(r"_proj\.weight$")  # q/k/v/o, gate/up/down, and every expert's


def _scale_grid(w: torch.Tensor, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """One scale per ``rows`` x ``cols`` block: its max-abs over 448, times a random factor
    in [1, 2) (so no two blocks share a scale, and no value overflows e4m3)."""
    n, k = w.shape
    s = torch.empty(n // rows, k // cols)
    for i in range(n // rows):
        for j in range(k // cols):
            block = w[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols]
            s[i, j] = block.abs().max().clamp_min(1e-6) / 448 * (1 + torch.rand((), generator=gen))
    return s


def quantize(
    w: torch.Tensor, kind: str, block: tuple[int, int], gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, the scale tensor as the format stores it, the dequantized float32 weight).
    ``kind``: "block" (scales [N/bn, K/bk], float32), "channel" ([N, 1], bf16) or "tensor"
    ([1], bf16)."""
    n, k = w.shape
    rows, cols = {"block": block, "channel": (1, k), "tensor": (n, k)}[kind]
    grid = _scale_grid(w.float(), rows, cols, gen)
    if kind != "block":  # compressed-tensors stores scales in the model's dtype (bf16)
        grid = grid.to(torch.bfloat16).float()
    q = torch.empty(n, k, dtype=E4M3)
    deq = torch.empty(n, k)
    for i in range(n // rows):
        for j in range(k // cols):
            sl = (slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols))
            q[sl] = (w[sl].float() / grid[i, j]).to(E4M3)
            deq[sl] = q[sl].float() * grid[i, j]
    if kind == "block":
        return q, grid, deq
    return q, (grid.reshape(1) if kind == "tensor" else grid).to(torch.bfloat16), deq


def quant_config(kind: str, block: tuple[int, int], keep: tuple[str, ...], static: bool) -> dict:
    """The config.json ``quantization_config`` of a checkpoint ``quantize`` wrote."""
    if kind == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block),
                "activation_scheme": "static" if static else "dynamic",
                "modules_to_not_convert": list(keep)}  # fmt: skip
    weights = {"num_bits": 8, "type": "float", "strategy": kind, "symmetric": True,
               "dynamic": False, "group_size": None, "block_structure": None}  # fmt: skip
    acts = {"num_bits": 8, "type": "float", "strategy": "tensor" if static else "token",
            "symmetric": True, "dynamic": not static}  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head", *keep],
            "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts}}}  # fmt: skip


def write_fp8(
    src: Path,
    dst_quant: Path,
    dst_ref: Path,
    kind: str,
    block: tuple[int, int] = (32, 16),
    keep: tuple[str, ...] = (),
    static: bool = False,
    seed: int = 0,
) -> tuple[Path, Path]:
    """From the float model at ``src``: an FP8 checkpoint at ``dst_quant`` (``kind`` as in
    `quantize`; modules named in ``keep`` stay float; ``static``: static input scales in the
    file) and its dequantized float twin at ``dst_ref``."""
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    weights = load_file(str(src / "model.safetensors"))
    quant: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    scale_name = "weight_scale_inv" if kind == "block" else "weight_scale"
    for name, w in weights.items():
        base = name.removesuffix(".weight")
        if not _LINEAR.search(name) or base in keep:
            quant[name] = ref[name] = w
            continue
        quant[name], quant[f"{base}.{scale_name}"], ref[name] = quantize(w, kind, block, gen)
        if static:
            quant[f"{base}.input_scale"] = torch.tensor([0.05])
    for dst, tensors in ((dst_quant, quant), (dst_ref, ref)):
        shutil.copytree(src, dst)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quant_config(kind, block, keep, static)
    (dst_quant / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst_quant, dst_ref
