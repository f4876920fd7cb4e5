#!/bin/bash
# The checks and A/Bs this session prepared and could not run (no device lent): native checks of
# the new paths, the tensor-core FP8 GEMV sweep + Qwen3-8B-FP8 batch 1, the SiLU-in-down A/B.
# Run from the repo root on the device: bash benchmark/gpu/run_session18.sh (OUT: a results folder).
export PYTHONUNBUFFERED=1
NEW=$PWD; SITE=$PYTHONPATH; T0=$SECONDS
export PYTHONPATH=$NEW:$SITE
t() { echo "[$((SECONDS - T0)) s] $*"; }
nvidia-smi --query-gpu=name --format=csv,noheader
t "tests"
timeout 170 python3 -m pytest -q -m gpu -n 4 -o addopts="" -p no:cacheprovider tests/unit/kernels/test_gemv.py \
  tests/unit/extensions/quantization/test_fp8_kernels.py tests/unit/extensions/quantization/test_fp8_moe.py \
  "tests/gpu/test_gpu_engine.py::test_silu_down_fusion_identical" "tests/gpu/test_gpu_engine.py::test_norm_gemv_fusion_teacher_forced" tests/gpu/test_fp8_gpu.py -rfE > $OUT/tests.log 2>&1
grep -E "passed|failed|FAILED|ERROR" $OUT/tests.log | tail -12
t "tc sweep"
timeout 120 python3 benchmark/gpu/bench_fp8.py --rows 1 --gemm-rows --tc 1 --write-tc-table $OUT/tc.json > $OUT/sweep.log 2>&1
grep -v "^  tc" $OUT/sweep.log | tail -9; cat $OUT/tc.json; echo
lat() {  # model [env] [args]
  [ $((SECONDS - T0)) -lt ${LIMIT:-380} ] || { t "skip latency $*"; return; }
  t "latency $*"
  env $2 timeout 75 python3 benchmark/offline/bench_latency.py --model benchmark/configs/$1 --load-format dummy $3 2>&1 | grep -iE "ms/token|error" | tail -2
}
[ -s $OUT/tc.json ] && lat Qwen3-8B-FP8 MINISGL_FP8_GEMV_TC=1 "--fp8-tc-table $OUT/tc.json"
lat Qwen3-8B-FP8 MINISGL_FP8_GEMV_TC=0
lat Qwen3-0.6B MINISGL_PDL=1 "--engine-arg disable_fused_silu_down=true"
lat Qwen3-0.6B MINISGL_PDL=1
lat Qwen3-0.6B MINISGL_PDL=1 "--engine-arg fused_norm_gemv=true"
lat Qwen3-8B
t done
