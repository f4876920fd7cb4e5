"""Load llama.cpp GGUF checkpoints: a Hugging Face style config, streamed weights, tokenizer.

GGUF differs from a Hugging Face checkpoint in four ways this module undoes:
- tensor names follow llama.cpp (``blk.3.attn_q.weight``) rather than HF (``model.layers.3...``);
- dims are stored innermost-first, i.e. reversed relative to torch;
- weights may be block-quantized: dequantized here through ``gguf.quants``, or handed over
  as raw blocks to the ``gguf`` quantization method where one is registered and takes every
  block type of the file (CPU kernels that read them quantized: extensions/quantization);
- for the ``llama`` architecture llama.cpp's converter interleaves the rows of q_proj/k_proj to
  suit its rotary kernel; qwen2/qwen3 are converted without that permutation.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType
from gguf.quants import dequantize

from minisgl.layers.quantization import parse_quant_config

if TYPE_CHECKING:
    from gguf.gguf_reader import ReaderTensor
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# GGUF ``general.architecture`` -> (HF architecture class, HF model_type).
_ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
# Architectures whose q/k rows llama.cpp's converter permuted (see _unpermute_rows).
_PERMUTED_QK = {"llama"}

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors with no HF parameter: llama3-style precomputed rope frequency factors, which HF derives
# from config.rope_scaling instead.
_IGNORED = {"rope_freqs"}
_NAME_RE = re.compile(r"^(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)$")

# Types the reader hands out as plain numpy arrays (everything else arrives as raw uint8 blocks).
_PLAIN_NUMPY = {
    GGMLQuantizationType.F64,
    GGMLQuantizationType.I8,
    GGMLQuantizationType.I16,
    GGMLQuantizationType.I32,
    GGMLQuantizationType.I64,
}


@functools.lru_cache(maxsize=4)
def _cached_reader(path: str, mtime_ns: int, size: int) -> GGUFReader:
    try:
        return GGUFReader(path, "r")
    except ValueError as exc:
        if "GGMLQuantizationType" not in str(exc):
            raise
        raise ValueError(f"GGUF file {path}: {_unknown_type(path)}") from None


def _unknown_type(path: str) -> str:
    """Which tensor has a block type gguf-py does not know (its reader only says the id)."""

    class Scan(GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            known = {int(t) for t in GGMLQuantizationType}
            for field in fields:  # parts: name length, name, dims, shape, type, offset
                qtype = int(field.parts[4][0])
                if qtype not in known:
                    name = bytes(field.parts[1]).decode(errors="replace")
                    raise LookupError(f"tensor {name!r} has unknown block type id {qtype}")

    try:
        Scan(path, "r")
    except LookupError as found:
        return str(found)
    return "a tensor has a block type gguf-py does not know"


def release_readers() -> None:
    """Drop the cached readers (and their memory maps); the next access parses again."""
    _cached_reader.cache_clear()


def _reader(path: str | Path) -> GGUFReader:
    # Parsing the header materialises every vocab/merges string (seconds for a 50k vocab), and
    # config, weights and tokenizer each need it; share one memory-mapped reader per file version.
    p = Path(path).expanduser().resolve()
    st = os.stat(p)
    return _cached_reader(str(p), st.st_mtime_ns, st.st_size)


def _meta(reader: GGUFReader, key: str, default: object = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _required(reader: GGUFReader, key: str) -> Any:
    value = _meta(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata is missing required key {key!r}")
    return value


def _uniform(value: Any, key: str) -> int:
    """Some GGUFs store per-layer lists (e.g. head_count_kv); we only support uniform layers."""
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise ValueError(f"non-uniform per-layer {key} is not supported: {value}")
        value = value[0]
    return int(value)


def _architecture(reader: GGUFReader) -> str:
    arch = str(_required(reader, "general.architecture"))
    if arch not in _ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCHS)}")
    return arch


def _head_counts(reader: GGUFReader, arch: str) -> tuple[int, int]:
    heads = _uniform(_required(reader, f"{arch}.attention.head_count"), "head_count")
    kv = _uniform(_meta(reader, f"{arch}.attention.head_count_kv", heads), "head_count_kv")
    return heads, kv


def _dtype_name(reader: GGUFReader) -> str:
    file_type = _meta(reader, "general.file_type")
    if file_type == LlamaFileType.ALL_F32:
        return "float32"
    if file_type == LlamaFileType.MOSTLY_F16:
        return "float16"
    # BF16 files, and quantized ones whose source precision is unknown: bf16 has f32's range, so
    # activations cannot overflow the way they sometimes do in fp16.
    return "bfloat16"


def _rope_scaling(reader: GGUFReader, arch: str) -> dict[str, object] | None:
    kind = _meta(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, object] = {"rope_type": str(kind)}
    factor = _meta(reader, f"{arch}.rope.scaling.factor")
    if factor is not None:
        scaling["factor"] = float(factor)
    orig = _meta(reader, f"{arch}.rope.scaling.original_context_length")
    if orig is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        value = _meta(reader, f"{arch}.rope.scaling.{gguf_key}")
        if value is not None:
            scaling[hf_key] = float(value)
    return scaling


def gguf_hf_config(path: str | Path) -> dict[str, object]:
    """Build a Hugging Face ``config.json``-like dict from GGUF metadata."""
    reader = _reader(path)
    arch = _architecture(reader)
    hf_arch, model_type = _ARCHS[arch]
    tensors = {t.name: t for t in reader.tensors}
    hidden = int(_required(reader, f"{arch}.embedding_length"))
    heads, kv_heads = _head_counts(reader, arch)
    embd = tensors.get("token_embd.weight")
    if embd is not None:  # the embedding's row count is what the weights actually have
        vocab = int(embd.shape[-1])
    else:
        vocab = int(_meta(reader, f"{arch}.vocab_size", 0)) or len(
            reader.fields["tokenizer.ggml.tokens"].data
        )
    rope_theta = float(_meta(reader, f"{arch}.rope.freq_base", 10000.0))
    rope_scaling = _rope_scaling(reader, arch)
    if "rope_freqs.weight" in tensors and rope_scaling is None:
        # llama.cpp stores Llama-3.1-style scaling only as baked per-dim factors, which cannot be
        # turned back into HF's rope_scaling parameters; outputs will drift from the original.
        logger.warning("%s carries rope_freqs (llama3 rope scaling), which is ignored", path)
    config: dict[str, object] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(_required(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_required(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(_meta(reader, f"{arch}.attention.key_length", hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": float(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        # transformers>=5 reads rope settings from rope_parameters; keep both spellings in sync.
        "rope_parameters": {
            "rope_type": "default",
            **(rope_scaling or {}),
            "rope_theta": rope_theta,
        },
        "max_position_embeddings": int(_meta(reader, f"{arch}.context_length", 2048)),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensors,
        # Qwen2's HF module hard-wires q/k/v biases; for the others the tensors tell.
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        "mlp_bias": False,
        "torch_dtype": _dtype_name(reader),
    }
    for key in ("bos", "eos", "padding"):
        token_id = _meta(reader, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[f"{key.replace('padding', 'pad')}_token_id"] = int(token_id)
    quant = _quantization_config(reader)
    if quant is not None:
        config["quantization_config"] = quant
    return config


def _quantization_config(reader: GGUFReader) -> dict[str, object] | None:
    """``{"quant_method": "gguf", "tensor_types": [...]}`` where the registered ``gguf``
    method keeps every block type of the file quantized; None (dequantize) otherwise."""
    types = sorted({t.tensor_type.name for t in reader.tensors if _is_quantized(t)})
    if not types:
        return None
    quant: dict[str, object] = {"quant_method": "gguf", "tensor_types": types}
    try:
        parse_quant_config(quant)
    except ValueError as exc:
        logger.info("GGUF weights are dequantized at load: %s", exc)
        return None
    return quant


def _is_quantized(tensor: ReaderTensor) -> bool:
    float_types = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
    return tensor.tensor_type not in _PLAIN_NUMPY and tensor.tensor_type not in float_types


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row interleave.

    HF orders each head's rotary dims as [first half | second half]; llama.cpp's converter
    reorders them to pairs (x0, x_{d/2}, x1, x_{d/2+1}, ...) so its kernel can rotate adjacent
    elements. Splitting each head's rows as (d/2, 2) and swapping back restores HF's order.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str | None:
    """Map a llama.cpp tensor name to its HF name; None for tensors HF has no parameter for."""
    match = _NAME_RE.match(gguf_name)
    if match is None:
        raise ValueError(f"unrecognised GGUF tensor name {gguf_name!r}")
    layer, stem, suffix = match.groups()
    if stem in _IGNORED:
        return None
    table = _TOP_LEVEL if layer is None else _PER_LAYER
    if stem not in table:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent we know of")
    prefix = "" if layer is None else f"model.layers.{layer}."
    return f"{prefix}{table[stem]}.{suffix}"


def _to_torch(tensor: ReaderTensor, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize one tensor to ``dtype`` in HF (torch) dim order."""
    qtype = tensor.tensor_type
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    data = tensor.data
    # Exact fast paths that skip the float32 detour when the caller wants the stored precision.
    if qtype == GGMLQuantizationType.F16 and dtype == torch.float16:
        return torch.from_numpy(np.array(data, dtype=np.float16)).reshape(shape)
    if qtype == GGMLQuantizationType.BF16 and dtype == torch.bfloat16:
        raw = np.array(data, dtype=np.uint8).view(np.int16)
        return torch.from_numpy(raw).view(torch.bfloat16).reshape(shape)
    if qtype in _PLAIN_NUMPY:
        values = np.asarray(data, dtype=np.float32)
    else:
        try:
            values = dequantize(data, qtype)
        except NotImplementedError:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} has block type {qtype.name}, which this "
                "installation's gguf package cannot decode"
            ) from None
    if not values.flags.writeable:  # F32 comes back as a view of the read-only memory map
        values = values.copy()
    return torch.from_numpy(values).reshape(shape).to(dtype)


def iter_gguf_weights(
    path: str | Path, dtype: torch.dtype = torch.float32, raw_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` pairs one at a time, dequantized to ``dtype``; with
    ``raw_quantized``, each quantized tensor instead as its blocks' bytes [rows, row bytes]
    under ``<layer>.gguf_<type>`` (e.g. ``model.layers.0.mlp.down_proj.gguf_q4_k``), for the
    ``gguf`` quantization method.

    Only the tensor being yielded is materialised; the file stays memory-mapped. Tied models have
    no ``output.weight``, so no ``lm_head.weight`` is yielded for them (see tie_word_embeddings).
    """
    reader = _reader(path)
    arch = _architecture(reader)
    heads, kv_heads = _head_counts(reader, arch)
    permuted = arch in _PERMUTED_QK
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            logger.warning("ignoring GGUF tensor %s (no Hugging Face equivalent)", tensor.name)
            continue
        if raw_quantized and _is_quantized(tensor):
            name = f"{name.rsplit('.', 1)[0]}.gguf_{tensor.tensor_type.name.lower()}"
            weight = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
        else:
            weight = _to_torch(tensor, dtype)
        if permuted and ".self_attn.q_proj." in name:
            weight = _unpermute_rows(weight, heads).contiguous()
        elif permuted and ".self_attn.k_proj." in name:
            weight = _unpermute_rows(weight, kv_heads).contiguous()
        yield name, weight


def load_gguf_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """A transformers tokenizer rebuilt from the GGUF vocabulary, with its chat template."""
    from transformers import AutoTokenizer  # heavy import; only tokenizer users pay for it

    p = Path(path).expanduser().resolve()
    tokenizer = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    reader = _reader(p)
    template = _meta(reader, "tokenizer.chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = str(template)
    # The GGUF's ids are what llama.cpp stops on; instruct conversions often point eos at the
    # end-of-turn token (e.g. <|im_end|>) rather than the base model's <|endoftext|>.
    for key, attr in (("eos", "eos_token"), ("bos", "bos_token"), ("padding", "pad_token")):
        token_id = _meta(reader, f"tokenizer.ggml.{key}_token_id")
        if token_id is None or getattr(tokenizer, f"{attr}_id") == int(token_id):
            continue
        if key != "eos" and getattr(tokenizer, attr) is not None:
            continue  # only eos is load-bearing enough to override what transformers chose
        setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(int(token_id)))
    return tokenizer
