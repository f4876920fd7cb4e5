#!/bin/bash
# Session 23: cuBLAS FP8 at any row count (the quantizers pad rows to a multiple of 4).
# PART=a (about 9 minutes): the FP8 GPU tests, the offline workload on Qwen3-8B-FP8 with this
# tree and with `old/` (the tree before the padding, carried), a profile of 30B-A3B-FP8's
# offline steps. PART=suite: the GPU suite. PART=b: the offline
# workload on Qwen3-8B bf16, Qwen3-30B-A3B-FP8 and Qwen3-30B-A3B; batch 1 for Qwen3-8B-FP8 and
# Qwen3-8B. PART=c: profile_steps.py (offline windows) on 30B-A3B bf16 and 8B, FP8 and bf16.
# Dummy weights. Run from the repo root on the device.
export PYTHONUNBUFFERED=1
T0=$SECONDS
t() { echo "[$((SECONDS - T0)) s] $*"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
off() {  # tree model [env]
  [ $((SECONDS - T0)) -lt ${LIMIT:-480} ] || { t "skip $*"; return; }
  t "offline $*"
  local log=$OUT/off_$1_$2_${3//=/_}.log
  (cd $1 && env PYTHONPATH=$PWD:$PYTHONPATH $3 timeout 110 python3 benchmark/offline/bench.py \
    --model benchmark/configs/$2 --load-format dummy) > $log 2>&1
  grep "tok/s" $log | head -1; grep -E "Error" $log | tail -2
}
lat() {  # model
  [ $((SECONDS - T0)) -lt ${LIMIT:-480} ] || { t "skip batch 1 $1"; return; }
  echo "batch 1 $1: $(PYTHONPATH=$PWD:$PYTHONPATH timeout 80 python3 \
    benchmark/offline/bench_latency.py --model benchmark/configs/$1 --load-format dummy 2>&1 |
    grep -iE "ms/token|error" | tail -1)"
}
suite() {  # log timeout [paths]
  t "GPU tests $1"
  PYTHONPATH=$PWD:$PYTHONPATH timeout $2 python3 -m pytest -q -m gpu -n 4 \
    --dist loadfile -o addopts="" ${@:3} > $OUT/$1.log 2>&1
  tail -15 $OUT/$1.log | grep -E "passed|failed|FAILED|Error"
}
profile() {  # model
  [ $((SECONDS - T0)) -lt ${LIMIT:-480} ] || { t "skip profile $1"; return; }
  t "profile $1"
  PYTHONPATH=$PWD:$PYTHONPATH timeout 200 python3 benchmark/gpu/profile_steps.py \
    --mode offline --model benchmark/configs/$1 2>&1 | grep -vE "Warning|warn" | tail -54
}
if [ "${PART:-a}" = a ]; then  # the FP8 GPU tests, offline 8B-FP8 new and old, a profile
  suite fp8 150 tests/gpu/test_fp8_gpu.py tests/unit/extensions/quantization \
    tests/unit/kernels/test_fused_ops.py
  off . Qwen3-8B-FP8
  off old Qwen3-8B-FP8
  profile Qwen3-30B-A3B-FP8
elif [ "$PART" = suite ]; then
  suite suite ${SUITE_S:-330} tests
elif [ "$PART" = b ]; then
  off . Qwen3-8B
  off . Qwen3-30B-A3B-FP8
  off . Qwen3-30B-A3B
  lat Qwen3-8B-FP8
  lat Qwen3-8B
else  # c: where an offline step's GPU time goes, FP8 and bf16
  for m in ${MODELS:-Qwen3-30B-A3B Qwen3-8B-FP8 Qwen3-8B}; do profile $m; done
fi
t done
