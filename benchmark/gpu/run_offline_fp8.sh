#!/bin/bash
# Issue 28's offline targets on one GPU (about 9 minutes; each model's bf16 twin in the same call):
# the offline workload on Qwen3-8B-FP8 vs Qwen3-8B, then FP8 without the activation quantization
# fused into the norm and SiLU-and-mul (the A/B of MINISGL_FP8_FUSED_ACT), and Qwen3-30B-A3B-FP8
# (the FP8 fused MoE) vs Qwen3-30B-A3B, dummy weights.
# Run from the repo root on the device: bash benchmark/gpu/run_offline_fp8.sh (OUT: a results folder).
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$SECONDS
t() { echo "[$((SECONDS - T0)) s] $*"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
off() {  # model [env]
  [ $((SECONDS - T0)) -lt ${LIMIT:-480} ] || { t "skip $*"; return; }
  t "offline $*"
  env $2 timeout 110 python3 benchmark/offline/bench.py --model benchmark/configs/$1 --load-format dummy \
    > $OUT/off_$1_${2//=/_}.log 2>&1
  grep "tok/s" $OUT/off_$1_${2//=/_}.log | head -1; grep -E "Error" $OUT/off_$1_${2//=/_}.log | tail -2
}
off Qwen3-8B-FP8
off Qwen3-8B
off Qwen3-8B-FP8 MINISGL_FP8_FUSED_ACT=0
off Qwen3-30B-A3B-FP8
off Qwen3-30B-A3B
t done
