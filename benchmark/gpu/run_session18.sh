#!/bin/bash
# The checks and A/Bs this session prepared and could not run (no device lent): native checks of
# the new paths, the FP8 few-row sweep + Qwen3-8B-FP8 batch 1, the batch-1 fusions' A/B.
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
t "fp8 few-row sweep"
timeout 150 python3 benchmark/gpu/bench_fp8.py --rows 1 --gemm-rows 16 64 --gemm-few > $OUT/sweep.log 2>&1
tail -20 $OUT/sweep.log
lat() {  # model [env] [args]
  [ $((SECONDS - T0)) -lt ${LIMIT:-520} ] || { t "skip latency $*"; return; }
  t "latency $*"
  env $2 timeout 75 python3 benchmark/offline/bench_latency.py --model benchmark/configs/$1 --load-format dummy $3 2>&1 | grep -iE "ms/token|error" | tail -2
}
lat Qwen3-8B-FP8
for i in 1 2 3; do  # the batch-1 fusions, interleaved (0.6B runs are bimodal across processes)
  lat Qwen3-0.6B MINISGL_PDL=1
  lat Qwen3-0.6B MINISGL_PDL=1 "--engine-arg fused_silu_down=true"
  lat Qwen3-0.6B MINISGL_PDL=1 "--engine-arg fused_norm_gemv=true"
done
lat Qwen3-8B
t done
