"""The core without the lower layers' extensions (flashinfer, peer_memory, quantization): in a
child process where those packages cannot be imported, an LLM starts and generates the same
greedy tokens as with them, and what they add is refused with a clear error: the flashinfer
backend (an unknown attention_backend), --disable-custom-all-reduce (an unknown option) and
a GPTQ checkpoint (an unknown quant_method)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from minisgl import LLM, SamplingParams

EXTENSIONS = ("flashinfer", "peer_memory", "quantization")
PROMPT = [5, 6, 7, 8]

_CHILD = """
import json, sys
for name in {extensions!r}:
    sys.modules["minisgl.extensions." + name] = None  # made unimportable
from minisgl.extension_loader import loaded_extensions
from minisgl.llm import LLM
from minisgl.sampling_params import SamplingParams

model, quantized = sys.argv[1], sys.argv[2]
with LLM(model) as llm:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = llm.generate([{prompt!r}], params)[0]["token_ids"]
errors = {{}}
for key, make in (
    ("backend", lambda: LLM(model, attention_backend="flashinfer")),
    ("option", lambda: LLM(model, disable_custom_all_reduce=True)),
    ("quant", lambda: LLM(quantized)),
):
    try:
        make()
    except ValueError as e:
        errors[key] = str(e)
print(json.dumps({{"loaded": loaded_extensions(), "tokens": tokens, "errors": errors}}))
"""


def test_core_runs_and_refuses_without_the_extensions(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    model = tiny_models["qwen3"]
    quantized = tmp_path / "gptq"
    shutil.copytree(model, quantized)
    cfg = json.loads((quantized / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (quantized / "config.json").write_text(json.dumps(cfg))
    with LLM(str(model)) as llm:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        want = llm.generate([PROMPT], params)[0]["token_ids"]

    code = _CHILD.format(extensions=EXTENSIONS, prompt=PROMPT)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", code, str(model), str(quantized)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not set(EXTENSIONS) & set(got["loaded"])
    assert got["tokens"] == want
    errors = got["errors"]
    assert "attention_backend='flashinfer' is invalid" in errors["backend"]
    assert "(torch, triton" in errors["backend"]
    assert "unknown option(s): disable_custom_all_reduce" in errors["option"]
    assert "quantization_config.quant_method='gptq' is not supported" in errors["quant"]
