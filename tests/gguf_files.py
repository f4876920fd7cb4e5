"""Tiny GGUF files for tests: every block type gguf can dequantize, llama.cpp's q/k row order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quant_shape_to_byte_shape, quantize

REQUIRED_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K]


def _dequantizable(qtype: Q) -> bool:
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _quantizable(qtype: Q) -> bool:
    try:
        quantize(np.zeros((1, 256), dtype=np.float32), qtype)
    except NotImplementedError:
        return False
    return True


EXTRA_TYPES = [t for t in Q if t not in REQUIRED_TYPES and _dequantizable(t)]
# Max |dequantized - original| for inputs ~ N(0, 0.5^2); ternary/fp4 types are too lossy to bound.
ROUNDTRIP_TOL = {
    Q.F32: 0.0,
    Q.F16: 2e-3,
    Q.BF16: 2e-2,
    Q.Q8_0: 0.03,
    Q.Q4_0: 0.4,
    Q.Q4_1: 0.4,
    Q.Q5_0: 0.2,
    Q.Q5_1: 0.2,
}


def _hf_to_gguf_rows(rows: int, n_head: int) -> np.ndarray:
    """Row order llama.cpp's converter writes q/k in, as indices into the HF rows.

    Within each head of size d, HF keeps rotary pairs at rows (i, i + d/2); llama.cpp stores them
    as adjacent rows (2i, 2i + 1). Written as explicit index arithmetic so that it is independent
    of the reshape/transpose used by the loader.
    """
    d = rows // n_head
    order = np.empty(rows, dtype=np.int64)
    for h in range(n_head):
        for i in range(d // 2):
            for j in range(2):
                order[h * d + 2 * i + j] = h * d + j * (d // 2) + i
    return order


def _random_blocks(shape: tuple[int, ...], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random quantized bytes for ``shape``, re-rolling blocks whose f16 scales decode to inf/nan."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block_size
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for _ in range(100):
        with np.errstate(invalid="ignore", over="ignore"):  # inf/nan scales are expected here
            bad = ~np.isfinite(dequantize(blocks, qtype)).all(axis=-1)
        if not bad.any():
            break
        blocks[bad] = rng.integers(0, 256, size=(int(bad.sum()), type_size), dtype=np.uint8)
    return blocks.reshape(quant_shape_to_byte_shape(shape, qtype))


def _encode(values: np.ndarray, qtype: Q, rng: np.random.Generator) -> tuple[np.ndarray, bool]:
    """Store ``values`` as ``qtype``; returns (stored array, whether it encodes ``values``)."""
    if qtype == Q.F32:
        return values.astype(np.float32), True
    if _quantizable(qtype):
        return quantize(values, qtype), True
    return _random_blocks(values.shape, qtype, rng), False


def _stored_as_float(stored: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    return np.asarray(dequantize(stored, qtype), dtype=np.float32).reshape(shape)


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    qtype: Q = Q.F32,
    *,
    layers: int = 2,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    inter: int = 512,
    vocab: int = 320,
    tied: bool = False,
    metadata: dict[str, Any] | None = None,
    seed: int = 0,
    overrides: dict[str, Q] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Write a tiny model; return (exact expected HF tensors, original floats where encoded).

    2-D weights are stored as ``qtype`` (or ``overrides[stem]``, e.g. ``{"attn_v": Q.Q6_K}``)
    and 1-D ones (norms, biases) as F32, as llama.cpp does.
    Expected tensors are computed from the stored bytes via gguf.quants.dequantize.
    """
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(50000.0)
    writer.add_vocab_size(vocab)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)

    exact: dict[str, torch.Tensor] = {}
    original: dict[str, torch.Tensor] = {}

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], n_head: int = 0) -> None:
        hf_values = (rng.standard_normal(shape) * 0.5).astype(np.float32)
        order = _hf_to_gguf_rows(shape[0], n_head) if n_head else np.arange(shape[0])
        file_values = hf_values[order]
        stem = gguf_name.split(".")[-2]
        tensor_type = (overrides or {}).get(stem, qtype) if len(shape) == 2 else Q.F32
        stored, encodes = _encode(file_values, tensor_type, rng)
        raw_dtype = tensor_type if stored.dtype == np.uint8 else None
        writer.add_tensor(gguf_name, stored, raw_dtype=raw_dtype)
        back = np.empty_like(hf_values)
        back[order] = _stored_as_float(stored, tensor_type, shape)
        exact[hf_name] = torch.from_numpy(back)
        if encodes:
            original[hf_name] = torch.from_numpy(hf_values)

    # llama.cpp permutes q/k rows only for the llama architecture (0 = leave rows as they are).
    q_perm, k_perm = (heads, kv_heads) if arch == "llama" else (0, 0)
    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
    add("token_embd.weight", "model.embed_tokens.weight", (vocab, hidden))
    add("output_norm.weight", "model.norm.weight", (hidden,))
    if not tied:
        add("output.weight", "lm_head.weight", (vocab, hidden))
    for i in range(layers):
        pre, hf = f"blk.{i}.", f"model.layers.{i}."
        add(pre + "attn_norm.weight", hf + "input_layernorm.weight", (hidden,))
        add(pre + "ffn_norm.weight", hf + "post_attention_layernorm.weight", (hidden,))
        add(pre + "attn_q.weight", hf + "self_attn.q_proj.weight", (q_rows, hidden), q_perm)
        add(pre + "attn_k.weight", hf + "self_attn.k_proj.weight", (kv_rows, hidden), k_perm)
        add(pre + "attn_v.weight", hf + "self_attn.v_proj.weight", (kv_rows, hidden))
        add(pre + "attn_output.weight", hf + "self_attn.o_proj.weight", (hidden, q_rows))
        if arch == "qwen2":
            add(pre + "attn_q.bias", hf + "self_attn.q_proj.bias", (q_rows,))
            add(pre + "attn_k.bias", hf + "self_attn.k_proj.bias", (kv_rows,))
            add(pre + "attn_v.bias", hf + "self_attn.v_proj.bias", (kv_rows,))
        if arch == "qwen3":
            add(pre + "attn_q_norm.weight", hf + "self_attn.q_norm.weight", (head_dim,))
            add(pre + "attn_k_norm.weight", hf + "self_attn.k_norm.weight", (head_dim,))
        add(pre + "ffn_gate.weight", hf + "mlp.gate_proj.weight", (inter, hidden))
        add(pre + "ffn_up.weight", hf + "mlp.up_proj.weight", (inter, hidden))
        add(pre + "ffn_down.weight", hf + "mlp.down_proj.weight", (hidden, inter))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return exact, original
