"""4-bit GPTQ/AWQ checkpoints (minisgl/extensions/quantization) on CPU: unpacking equals a
per-element reading of the published formats; our engine on a quantized checkpoint gives Hugging Face's
greedy tokens on the dequantized float twin (tests/int4_checkpoints.py writes both), at
TP=1 and TP=2; unsupported settings fail at load with the field named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams, env
from minisgl.extensions.quantization import INT4_GEMV
from minisgl.extensions.quantization import int4 as q
from minisgl.layers.quantization import parse_quant_config, quant_method_names
from tests.helpers import TinyModels, assert_engine_clean, hf_greedy
from tests.int4_checkpoints import AWQ_PACK_ORDER, write_quantized

PROMPTS = [[5, 6, 7], list(range(40, 73)), [3] * 21]
N_NEW = 16


def _words(rows: int, cols: int, seed: int) -> torch.Tensor:
    # Full 32-bit range, so the top nibble's sign bit is exercised.
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (rows, cols), generator=g, dtype=torch.int64).to(
        torch.int32
    )


def _nibble(word: int, i: int) -> int:
    return ((word & 0xFFFFFFFF) >> (4 * i)) & 0xF


def test_unpack_gptq_matches_per_element_reading() -> None:
    k, n = 24, 5
    qweight = _words(k // 8, n, 0)
    codes = q.unpack_qweight(qweight, "gptq")  # [N, K]
    assert codes.shape == (n, k) and codes.dtype == torch.uint8
    for nn_ in range(n):
        for kk in range(k):
            assert codes[nn_, kk] == _nibble(int(qweight[kk // 8, nn_]), kk % 8)
    qzeros = _words(3, 2, 1)  # 3 groups, N = 16
    zeros = q.unpack_qzeros(qzeros, q.Int4Method("gptq", 8, zero_offset=1))  # [N, groups]
    for nn_ in range(16):
        for gg in range(3):
            assert zeros[nn_, gg] == _nibble(int(qzeros[gg, nn_ // 8]), nn_ % 8) + 1


def test_unpack_awq_matches_per_element_reading() -> None:
    k, n = 6, 24
    qweight = _words(k, n // 8, 2)
    codes = q.unpack_qweight(qweight, "awq")
    assert codes.shape == (n, k)
    for nn_ in range(n):
        nib = AWQ_PACK_ORDER.index(nn_ % 8)  # the interleave: column 8c + order[i] at nibble i
        for kk in range(k):
            assert codes[nn_, kk] == _nibble(int(qweight[kk, nn_ // 8]), nib)
    qzeros = _words(2, 2, 3)
    zeros = q.unpack_qzeros(qzeros, q.Int4Method("awq", 8))
    for nn_ in range(16):
        for gg in range(2):
            want = _nibble(int(qzeros[gg, nn_ // 8]), AWQ_PACK_ORDER.index(nn_ % 8))
            assert zeros[nn_, gg] == want


def test_canonical_pack_matches_per_element_reading() -> None:
    codes = torch.randint(0, 16, (7, 32), generator=torch.Generator().manual_seed(4))
    packed = q.pack_canonical(codes.to(torch.uint8))
    assert packed.shape == (4, 7) and packed.dtype == torch.int32
    for nn_ in range(7):
        for kk in range(32):
            assert _nibble(int(packed[kk // 8, nn_]), kk % 8) == codes[nn_, kk]


@pytest.fixture(scope="module")
def quantized(
    tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, Path]]:
    """name -> (quantized checkpoint, dequantized float twin)."""
    root = tmp_path_factory.mktemp("int4")
    llama = tiny_models.build("llama", seed=3)
    qwen2 = tiny_models.build("qwen2", seed=4)  # qkv bias stays float
    qwen3 = tiny_models.build("qwen3", seed=5)
    out = {}
    for name, src, method, group in (
        ("llama_gptq_g32", llama, "gptq", 32),
        ("llama_awq_g64", llama, "awq", 64),
        ("qwen2_awq_g32", qwen2, "awq", 32),
        ("qwen3_gptq_gall", qwen3, "gptq", -1),
    ):
        out[name] = write_quantized(src, root / f"{name}_q", root / f"{name}_ref", method, group)
    return out


@pytest.mark.parametrize(
    "name", ["llama_gptq_g32", "llama_awq_g64", "qwen2_awq_g32", "qwen3_gptq_gall"]
)
def test_quantized_matches_hf_on_dequantized(
    quantized: dict[str, tuple[Path, Path]], name: str
) -> None:
    qpath, ref_path = quantized[name]
    ref_tokens, ref_lps = hf_greedy(ref_path, PROMPTS, N_NEW)
    llm = LLM(str(qpath), page_size=4)
    assert llm.engine.model_config.quant is not None
    out = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=True)
    )
    for res, toks, lps in zip(out, ref_tokens, ref_lps):
        assert res["token_ids"] == toks
        assert max(abs(a - b) for a, b in zip(res["logprobs"], lps)) < 1e-4
    # CPU dequantizes once at load: the layers hold float weights, no packed tensors.
    layer = llm.engine.model.model.layers[0]  # type: ignore[union-attr,index]
    qkv = layer.self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float32 and not hasattr(qkv, "scales")
    assert_engine_clean(llm)


@pytest.mark.timeout(180)
def test_quantized_tp2_matches_tp1(quantized: dict[str, tuple[Path, Path]]) -> None:
    """Column-parallel shards split N (merged q/k/v, gate/up), row-parallel ones K by whole
    groups; group_size -1 keeps its one group's scales on every rank."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for name in ("llama_gptq_g32", "qwen2_awq_g32", "qwen3_gptq_gall"):
        path = str(quantized[name][0])
        ref = LLM(path)
        want = [r["token_ids"] for r in ref.generate(PROMPTS, params)]
        del ref
        with env.override({env.DIST_TIMEOUT_S: 60}), LLM(path, tp_size=2) as tp2:
            assert [r["token_ids"] for r in tp2.generate(PROMPTS, params)] == want, name


def _edit_config(path: Path, **fields: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(fields)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"bits": 8}, "bits=8"),
        ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
        ({"checkpoint_format": "marlin"}, "checkpoint_format"),
    ],
)
def test_unsupported_gptq_settings_name_the_field(
    tiny_models: dict[str, Path], tmp_path: Path, fields: dict[str, object], named: str
) -> None:
    src = tiny_models["llama"]
    qpath, _ = write_quantized(src, tmp_path / "q", tmp_path / "r", "gptq", 32)
    _edit_config(qpath, **fields)
    with pytest.raises(ValueError, match=named.replace("[", r"\[")):
        LLM(str(qpath))


def test_unsupported_awq_settings_name_the_field(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    src = tiny_models["llama"]
    qpath, _ = write_quantized(src, tmp_path / "q", tmp_path / "r", "awq", 32)
    _edit_config(qpath, version="gemv")
    with pytest.raises(ValueError, match="version='gemv'"):
        LLM(str(qpath))
    _edit_config(qpath, version="gemm", zero_point=False)
    with pytest.raises(ValueError, match="zero_point"):
        LLM(str(qpath))


def test_act_order_g_idx_is_refused(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    src = tiny_models["llama"]
    qpath, _ = write_quantized(src, tmp_path / "q", tmp_path / "r", "gptq", 32)
    _edit_config(qpath, desc_act=True)
    weights = load_file(str(qpath / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.g_idx"
    weights[name] = weights[name].flip(0).contiguous()  # act-order: groups out of input order
    save_file(weights, str(qpath / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="desc_act=True"):
        LLM(str(qpath))


def test_registered_for_gptq_and_awq() -> None:
    assert {"gptq", "awq"} <= set(quant_method_names())
    method = parse_quant_config({"quant_method": "GPTQ", "bits": 4, "group_size": 32})
    assert method == q.Int4Method("gptq", 32, zero_offset=1) and method.name == "gptq"
    assert parse_quant_config(None) is None and parse_quant_config({}) is None
    with pytest.raises(ValueError, match=r"quant_method='fp4' is not supported \(methods: "):
        parse_quant_config({"quant_method": "fp4"})


def test_moe_checkpoint_is_refused() -> None:
    from minisgl.models.config import ModelConfig

    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_attention_heads": 4,
        "hidden_size": 64,
        "vocab_size": 128,
        "num_hidden_layers": 1,
        "num_experts": 4,
        "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32},
    }
    with pytest.raises(ValueError, match="quant_method='awq' is not supported for mixture"):
        ModelConfig.from_dict(cfg)


def test_int4_forward_routes_rows_to_gemv_or_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """int4_forward (reached only by CUDA layers; here with the kernels replaced by
    recorders): 1-4 rows take the GEMV, more the GEMM; MINISGL_INT4_GEMV=0 keeps the GEMM
    for every row count."""
    pytest.importorskip("triton")
    from minisgl.extensions.quantization.kernels import int4_gemm, int4_gemv

    assert q.INT4_GEMV_MAX_ROWS == int4_gemv.MAX_ROWS
    calls: list[str] = []
    layer = torch.nn.Module()
    layer.register_buffer("qweight", torch.zeros(8, 16, dtype=torch.int32))  # K = 64
    layer.register_buffer("qzeros", torch.zeros(2, 16, dtype=torch.uint8))  # groups of 32
    layer.register_buffer("scales", torch.zeros(2, 16))

    def recorder(name: str):  # type: ignore[no-untyped-def]
        def kernel(x, qweight, scales, zeros, group, bias):  # type: ignore[no-untyped-def]
            assert qweight is layer.qweight and zeros is layer.qzeros and group == 32
            calls.append(name)
            return x

        return kernel

    monkeypatch.setattr(int4_gemv, "int4_gemv", recorder("gemv"))
    monkeypatch.setattr(int4_gemm, "int4_gemm", recorder("gemm"))
    for enabled, want in ((True, ["gemv"] * 4 + ["gemm"] * 3), (False, ["gemm"] * 7)):
        calls.clear()
        with env.override({INT4_GEMV: enabled}):
            for rows in (1, 2, 3, 4, 5, 16, 300):
                q.Int4Method("gptq", 32).apply(layer, torch.zeros(rows, 64), None)
        assert calls == want
    assert not q.use_int4_gemv(0, True) and q.use_int4_gemv(4, True)
    assert not q.use_int4_gemv(1, False) and not q.use_int4_gemv(5, True)


def test_int4_gemv_env_switch() -> None:
    import subprocess
    import sys

    code = "from minisgl.extensions.quantization import INT4_GEMV; print(INT4_GEMV.get())"
    for value, want in (("0", "False"), ("off", "False"), ("1", "True")):
        child = env.child_environ({INT4_GEMV: value})
        root = Path(__file__).resolve().parents[4]
        out = subprocess.run(
            [sys.executable, "-c", code], env=child, capture_output=True, text=True, cwd=root
        )
        assert out.stdout.strip() == want, out.stderr
