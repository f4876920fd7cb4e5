#!/bin/bash
# Session 19, one call: the FP8 GEMM on cuBLASLt's block scaling (torch._scaled_mm) against the
# Triton W8A8 GEMM and bf16 cuBLAS, its GPU checks, and the offline workload on Qwen3-8B-FP8
# (cuBLAS on / off) vs Qwen3-8B and on Qwen3-30B-A3B-FP8 with the FP8 fused MoE (the loader
# no longer keeps the bf16-form experts alive while they become e4m3).
# Run from the repo root on the device: bash benchmark/gpu/run_session19.sh (OUT: a results folder).
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$SECONDS
t() { echo "[$((SECONDS - T0)) s] $*"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 - <<'PY'
import torch
from minisgl.extensions.quantization.kernels.fp8_gemm import cublas_fp8_gemm
print("torch", torch.__version__, "CUDA", torch.version.cuda)
x = torch.randn(40, 256, device="cuda").bfloat16()
w = torch.randn(256, 256, device="cuda").to(torch.float8_e4m3fn)
try:
    print("cuBLASLt block FP8:", cublas_fp8_gemm(x, w, torch.ones(2, 2, device="cuda")).shape)
except Exception as e:
    print("cuBLASLt block FP8 fails:", type(e).__name__, str(e)[:300])
PY
t "tests"
timeout 150 python3 -m pytest -q -m gpu -n 4 -o addopts="" -p no:cacheprovider tests/gpu/test_fp8_gpu.py \
  tests/unit/extensions/quantization/test_fp8_kernels.py -rfE > $OUT/tests.log 2>&1
grep -E "passed|failed|FAILED|ERROR|SKIP" $OUT/tests.log | tail -12
t "gemm sweep"
timeout 100 python3 benchmark/gpu/bench_fp8.py --rows --gemm-rows 16 64 256 2048 8192 > $OUT/sweep.log 2>&1
cat $OUT/sweep.log | tail -34
if grep -q "block-scaled FP8: False" $OUT/sweep.log; then  # no cuBLAS recipe: the Triton tiles
  timeout 100 python3 benchmark/gpu/bench_fp8.py --rows --gemm-rows 256 8192 --gemm-sweep 2>&1 | tail -12
fi
off() {  # model [env]
  [ $((SECONDS - T0)) -lt ${LIMIT:-480} ] || { t "skip $*"; return; }
  t "offline $*"
  env $2 timeout 120 python3 benchmark/offline/bench.py --model benchmark/configs/$1 --load-format dummy \
    > $OUT/off_$1_${2//=/_}.log 2>&1
  grep "tok/s" $OUT/off_$1_${2//=/_}.log | head -2 | cut -c1-400; grep -E "Error" $OUT/off_$1_${2//=/_}.log | tail -2
}
off Qwen3-30B-A3B-FP8 MINISGL_FP8_MOE_KERNELS=1
off Qwen3-8B-FP8 MINISGL_FP8_CUBLAS=1
off Qwen3-8B
off Qwen3-8B-FP8 MINISGL_FP8_CUBLAS=0
if [ -d base ]; then  # the H100's offline host regression (RESULTS 2026-12-06): main vs ./base
  off Qwen3-0.6B
  [ $((SECONDS - T0)) -lt ${LIMIT:-480} ] && (cd base && PYTHONPATH=$PWD:${PYTHONPATH#*:} timeout 100 \
    python3 benchmark/offline/bench.py --model benchmark/configs/Qwen3-0.6B --load-format dummy \
    2>&1 | grep "tok/s" | head -2 | cut -c1-400)
fi
t done
