"""4-bit GPTQ and AWQ checkpoints: one internal layout for both, one GEMM kernel.

Checkpoint formats (Hugging Face ``quantization_config``), for a linear y = x W^T with
W [N, K], integer codes q in 0..15, zero points z and scales s per group of ``group_size``
inputs, W[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G]:

* GPTQ: ``qweight`` int32 [K/8, N], nibble j of word (r, n) = q[n, 8r + j] (packed along K);
  ``qzeros`` int32 [K/G, N/8], nibble j of word (g, c) = z[8c + j, g] - 1 (the historical
  "v1" offset; ``checkpoint_format: gptq_v2`` stores z itself); ``scales`` [K/G, N];
  ``g_idx`` [K] (group of each input; k // G unless act-order reordered it).
* AWQ (GEMM version): ``qweight`` int32 [K, N/8] packed along N, nibble i of word (k, c)
  holding column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]; ``qzeros`` [K/G, N/8] packed the same
  way (no offset); ``scales`` [K/G, N].

Loading unpacks every tensor on its own (they arrive one at a time) into an N-major form,
codes uint8 [N, K], zeros uint8 [N, K/G], scales float32 [N, K/G], so the float layers'
sharding along N (merged q/k/v and gate/up shards, column-parallel TP) applies unchanged,
and row-parallel TP narrows K by whole groups. ``finish_loading`` then turns that into what
the device computes with: on CPU the dequantized weight in the compute dtype (CPU serves
tests and small models, so it dequantizes once and runs the float path); on CUDA the
canonical packed layout of kernels/int4_gemm.py, int32 [K/8, N] (GPTQ's order, whatever
the checkpoint's) with float32 scales and uint8 zeros [K/G, N], dequantized tile by tile
inside the GEMM (kernels/int4_gemv.py for 1-4 rows, unless MINISGL_INT4_GEMV=0).

`Int4Method` is the method (layers/quantization.py's interface) for both formats.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from minisgl.extensions.quantization.switches import INT4_GEMV
from minisgl.layers.quantization import ShardFn

# Column j of each group of 8 sits at nibble AWQ_NIBBLE[j] (inverse of the packing order).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_NIBBLE = tuple(AWQ_ORDER.index(j) for j in range(8))  # (0, 4, 1, 5, 2, 6, 3, 7)


@dataclass(frozen=True)
class Int4Method:
    """4-bit GPTQ or AWQ weights (a layers/quantization.py QuantMethod)."""

    name: str  # the checkpoint's quant_method: "gptq" or "awq"
    group_size: int  # -1: one group over the whole input
    zero_offset: int = 0  # added to stored zeros (GPTQ v1: 1)

    def groups(self, in_features: int) -> int:
        """Group size for a layer of ``in_features`` (full, unsharded) inputs."""
        return in_features if self.group_size <= 0 else self.group_size

    def create_weights(
        self, layer: nn.Module, out_features: int, in_local: int, in_full: int, load_shard: ShardFn
    ) -> None:
        add_int4_params(layer, out_features, in_local, in_full, self, load_shard)

    def finish_loading(self, layer: nn.Module, dtype: torch.dtype) -> bool:
        return finish_int4(layer, dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return int4_forward(layer, x, bias)


def config_int(value: object) -> int:
    """A number of the config (JSON: int, float or str); 0 for anything else."""
    return int(value) if isinstance(value, (int, float, str)) else 0


def parse_int4(d: Mapping[str, object]) -> Int4Method:
    """The method of a GPTQ or AWQ ``quantization_config``. Raises ValueError naming the
    field of any setting this engine does not run."""
    method = str(d.get("quant_method", "")).lower()
    bits = config_int(d.get("bits", d.get("w_bit")) or 0)
    if bits != 4:
        raise ValueError(f"quantization_config.bits={bits} is not supported (4-bit only)")
    group = config_int(d.get("group_size", d.get("q_group_size")) or -1)
    if group != -1 and (group <= 0 or group % 8):
        raise ValueError(f"quantization_config.group_size={group} is not supported")
    if method == "awq":
        version = str(d.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config.version={version!r} is not supported (gemm)")
        if not d.get("zero_point", True):
            raise ValueError("quantization_config.zero_point=false is not supported")
        return Int4Method("awq", group)
    fmt = str(d.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config.checkpoint_format={fmt!r} is not supported")
    # desc_act (act-order) is refused at load, where g_idx shows whether it reorders groups.
    return Int4Method("gptq", group, zero_offset=1 if fmt == "gptq" else 0)


# ------------------------------------------------------------------ unpacking (load time)
def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., C] -> int32 [..., C, 8]: nibble i of each word (i = 0 lowest)."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    return (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF


def unpack_along_n(packed: torch.Tensor, method: str) -> torch.Tensor:
    """[R, N/8] words packed along N (AWQ qweight/qzeros, GPTQ qzeros) -> int32 [R, N]."""
    vals = _nibbles(packed)
    if method == "awq":
        vals = vals[..., list(AWQ_NIBBLE)]
    return vals.reshape(packed.shape[0], -1)


def unpack_gptq_qweight(packed: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight int32 [K/8, N] -> int32 [K, N]."""
    vals = _nibbles(packed)  # [K/8, N, 8]
    return vals.permute(0, 2, 1).reshape(-1, packed.shape[1])


def unpack_qweight(packed: torch.Tensor, method: str) -> torch.Tensor:
    """A checkpoint's qweight -> codes uint8 [N, K] (N-major, like a float weight)."""
    kn = unpack_gptq_qweight(packed) if method == "gptq" else unpack_along_n(packed, "awq")
    return kn.t().contiguous().to(torch.uint8)


def unpack_qzeros(packed: torch.Tensor, quant: Int4Method) -> torch.Tensor:
    """A checkpoint's qzeros [K/G, N/8] -> zero points uint8 [N, K/G] (offset applied; a
    GPTQ v1 zero of 15 reads 16, as in AutoGPTQ's own dequantization)."""
    z = unpack_along_n(packed, quant.name) + quant.zero_offset
    return z.t().contiguous().to(torch.uint8)


def pack_canonical(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (0..15, K % 8 == 0) -> int32 [K/8, N], nibble j of word (r, n) = codes
    [n, 8r + j]: the kernel's layout (a K tile of a column is one word per 8 inputs)."""
    n, k = codes.shape
    c = codes.t().to(torch.int32).reshape(k // 8, 8, n)
    out = torch.zeros(k // 8, n, dtype=torch.int32, device=codes.device)
    for j in range(8):
        out |= c[:, j] << (4 * j)
    return out


def dequantize(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [N, K], zeros/scales [N, K/G] -> float32 W [N, K]."""
    group = codes.shape[1] // zeros.shape[1]
    z = zeros.to(torch.float32).repeat_interleave(group, dim=1)
    s = scales.to(torch.float32).repeat_interleave(group, dim=1)
    return (codes.to(torch.float32) - z) * s


# ------------------------------------------------------------------ the layer's parameters
def add_int4_params(
    layer: nn.Module,
    out_features: int,
    in_local: int,
    in_full: int,
    quant: Int4Method,
    load_shard: ShardFn,
) -> None:
    """Register the load-time parameters (N-major, see the module docstring) on ``layer``,
    each with a weight_loader that unpacks the checkpoint tensor and hands it to the layer's
    ``load_shard`` (which narrows N or K exactly as for a float weight)."""
    group = quant.groups(in_full)
    if in_full % group or (quant.group_size > 0 and in_local % group):
        raise ValueError(
            f"quantization_config.group_size={quant.group_size} does not divide the layer's "
            f"{in_full} inputs into whole groups per tensor-parallel rank ({in_local} each)"
        )
    if in_local % 8:
        raise ValueError(f"int4 layers need inputs in multiples of 8 per rank, got {in_local}")
    # group_size -1 under row-parallel TP: the one group spans every rank; each keeps all of
    # its (replicated) scales/zeros column, and its group is its local inputs.
    n_groups = max(in_local // group, 1)
    empty = torch.empty
    qweight = nn.Parameter(empty(out_features, in_local, dtype=torch.uint8), requires_grad=False)
    qzeros = nn.Parameter(empty(out_features, n_groups, dtype=torch.uint8), requires_grad=False)
    scales = nn.Parameter(empty(out_features, n_groups, dtype=torch.float32), requires_grad=False)
    g_idx = nn.Parameter(empty(0, dtype=torch.int32), requires_grad=False)
    converters: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "qweight": lambda t: unpack_qweight(t, quant.name),
        "qzeros": lambda t: unpack_qzeros(t, quant),
        "scales": lambda t: t.to(torch.float32).t(),
    }
    for name, p in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        convert = converters[name]

        def loader(
            param: nn.Parameter,
            loaded: torch.Tensor,
            shard: int = 0,
            convert: Callable[[torch.Tensor], torch.Tensor] = convert,
        ) -> None:
            load_shard(param, convert(loaded), shard)

        register_raw(layer, name, p, loader)
    if quant.name == "gptq":  # gptq_v2 exports may omit g_idx
        register_raw(layer, "g_idx", g_idx, lambda _p, t, _s: check_g_idx(t, group), True)


RawLoader = Callable[[nn.Parameter, torch.Tensor, int], None]


def register_raw(
    layer: nn.Module, name: str, p: nn.Parameter, loader: RawLoader | None, optional: bool = False
) -> None:
    """Register a load-time parameter whose ``loader`` takes the checkpoint tensor as stored
    (models/loader.py casts nothing: the loader converts); ``optional``: the checkpoint may
    lack it (no loader: it never comes from the checkpoint)."""
    layer.register_parameter(name, p)
    if loader is not None:
        p.weight_loader = loader  # type: ignore[attr-defined]
    p.raw_checkpoint = True  # type: ignore[attr-defined]
    p.optional = optional or loader is None  # type: ignore[attr-defined]


def check_g_idx(g_idx: torch.Tensor, group: int) -> None:
    """Only the trivial order (input k in group k // G) is supported: act-order checkpoints
    (desc_act=True) permute the inputs' groups, which this kernel does not gather."""
    want = torch.arange(g_idx.numel(), device=g_idx.device) // group
    if not torch.equal(g_idx.to(torch.int64), want):
        raise ValueError(
            "quantization_config.desc_act=True (act-order GPTQ with a reordered g_idx) is "
            "not supported; use a checkpoint quantized with desc_act=False"
        )


def finish_int4(layer: nn.Module, dtype: torch.dtype) -> bool:
    """After loading: CPU -> a float ``weight`` in ``dtype`` (False: the float path runs);
    CUDA -> the kernel's packed buffers (True: `int4_forward` computes the layer)."""
    codes, zeros, scales = (layer.get_parameter(n).data for n in ("qweight", "qzeros", "scales"))
    for name in ("qweight", "qzeros", "scales", "g_idx"):
        if name in layer._parameters:
            delattr(layer, name)
    if codes.device.type != "cuda":
        w = dequantize(codes, zeros, scales).to(dtype)
        layer.register_parameter("weight", nn.Parameter(w, requires_grad=False))
        return False
    # Buffers, not parameters: nothing loads into them, and pack_model skips them.
    layer.register_buffer("qweight", pack_canonical(codes), persistent=False)
    layer.register_buffer("qzeros", zeros.t().contiguous(), persistent=False)
    layer.register_buffer("scales", scales.t().contiguous(), persistent=False)
    return True


INT4_GEMV_MAX_ROWS = 4  # kernels/int4_gemv.py's MAX_ROWS (not imported: CPU needs no triton)


def use_int4_gemv(rows: int, enabled: bool | None = None) -> bool:
    """Whether a product of ``rows`` rows runs the batch-1 GEMV rather than the GEMM
    (``enabled``: the INT4_GEMV switch unless given). Only CUDA layers reach int4_forward."""
    on = INT4_GEMV.get() if enabled is None else enabled
    return on and 0 < rows <= INT4_GEMV_MAX_ROWS


def int4_forward(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ bias) on the buffers `finish_int4` left (qweight [K/8, N], zeros [K/G, N])."""
    # The module's own dict (nn.Module attribute lookup and get_buffer cost microseconds a
    # call, per layer of every eager step).
    qweight, scales, zeros = (layer._buffers[n] for n in ("qweight", "scales", "qzeros"))
    assert qweight is not None and scales is not None and zeros is not None
    group = qweight.shape[0] * 8 // zeros.shape[0]
    if use_int4_gemv(x.shape[0]):
        from minisgl.extensions.quantization.kernels import int4_gemv

        return int4_gemv.int4_gemv(x, qweight, scales, zeros, group, bias)
    from minisgl.extensions.quantization.kernels import int4_gemm

    return int4_gemm.int4_gemm(x, qweight, scales, zeros, group, bias)
