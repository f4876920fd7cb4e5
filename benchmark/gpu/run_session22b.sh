#!/bin/bash
# Session 22, call 2 (about 8 minutes): Qwen3-8B-FP8 batch 1 (default, with fused_silu_down)
# beside Qwen3-8B bf16; the offline workload on Qwen3-8B-FP8 vs Qwen3-8B, then FP8 with
# MINISGL_FP8_FUSED_ACT=0 (dummy weights). Run from the repo root on the device (OUT: a folder).
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$SECONDS
t() { echo "[$((SECONDS - T0)) s] $*"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
lat() {  # model [args]
  local m=$1; shift
  timeout 80 python3 benchmark/offline/bench_latency.py --model benchmark/configs/$m \
    --load-format dummy "$@" 2>&1 | grep -iE "ms/token|error" | tail -1
}
t "batch 1"
echo "8B-FP8 $(lat Qwen3-8B-FP8)"
echo "8B-FP8 fused_silu_down $(lat Qwen3-8B-FP8 --engine-arg fused_silu_down=true)"
echo "8B bf16 $(lat Qwen3-8B)"
off() {  # model [env]
  [ $((SECONDS - T0)) -lt ${LIMIT:-470} ] || { t "skip $*"; return; }
  t "offline $*"
  env $2 timeout 110 python3 benchmark/offline/bench.py --model benchmark/configs/$1 \
    --load-format dummy > $OUT/off_$1_${2//=/_}.log 2>&1
  grep "tok/s" $OUT/off_$1_${2//=/_}.log | head -1; grep -E "Error" $OUT/off_$1_${2//=/_}.log | tail -2
}
off Qwen3-8B-FP8
off Qwen3-8B
off Qwen3-8B-FP8 MINISGL_FP8_FUSED_ACT=0
t done
