"""The ``quantization_config`` of FP8 checkpoints (fp8.py describes the formats) -> `Fp8Method`,
or ValueError naming the field of any setting the engine does not run."""

from __future__ import annotations

from collections.abc import Mapping

from minisgl.extensions.quantization.fp8 import Fp8Method
from minisgl.extensions.quantization.int4 import config_int


def _section(value: object, field: str) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{field}={value!r} is not supported (a mapping)")
    return value


def parse_fp8(d: Mapping[str, object]) -> Fp8Method:
    """The method of a ``quant_method: fp8`` config; ValueError naming any field it does not run."""
    fmt = str(d.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt={fmt!r} is not supported (e4m3 only)")
    scheme = str(d.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"quantization_config.activation_scheme={scheme!r} is not supported")
    size = d.get("weight_block_size")
    if size is not None and not (
        isinstance(size, list) and len(size) == 2 and all(config_int(b) > 0 for b in size)
    ):
        raise ValueError(f"quantization_config.weight_block_size={size!r} is not supported")
    block = (config_int(size[0]), config_int(size[1])) if isinstance(size, list) else None
    static = "quantization_config.activation_scheme='static'" if scheme == "static" else ""
    return Fp8Method("fp8", "weight_scale_inv", block, static_field=static)


def _expect(section: Mapping[str, object], field: str, **want: object) -> None:
    for key, value in want.items():
        got = section.get(key, True if key == "symmetric" else None)
        if got != value:
            raise ValueError(f"{field}.{key}={got!r} is not supported ({value!r} only)")


def parse_compressed_tensors(d: Mapping[str, object]) -> Fp8Method:
    """The method of a compressed-tensors ``float-quantized`` config (FP8 weights per channel
    or per tensor); ValueError naming any field it does not run."""
    root = "quantization_config"
    _expect(d, root, format="float-quantized")
    groups = _section(d.get("config_groups"), f"{root}.config_groups")
    strategies: set[str] = set()
    static = ""
    for key, value in groups.items():
        field = f"{root}.config_groups.{key}"
        weights = _section(_section(value, field).get("weights"), f"{field}.weights")
        _expect(weights, f"{field}.weights", num_bits=8, type="float", symmetric=True)
        strategy = str(weights.get("strategy"))
        if strategy not in ("channel", "tensor"):
            raise ValueError(f"{field}.weights.strategy={strategy!r} is not supported")
        strategies.add(strategy)
        acts = _section(value, field).get("input_activations")
        if acts is not None:
            acts = _section(acts, f"{field}.input_activations")
            _expect(acts, f"{field}.input_activations", num_bits=8, type="float")
            if not acts.get("dynamic"):
                static = f"{field}.input_activations.dynamic=false"
    if len(strategies) != 1:
        raise ValueError(f"{root}.config_groups: weights.strategy {sorted(strategies)} (one only)")
    return Fp8Method(
        "compressed-tensors",
        "weight_scale",
        per_channel="channel" in strategies,
        static_field=static,
    )
