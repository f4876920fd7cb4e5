#!/bin/bash
# Session 24: the MoE alignment with its chunk counts expert-major (the cross-chunk cumsum along
# the contiguous dimension), then where batch-1 decode's time goes. Run from the repo root on
# the device: the alignment's timings and MoE GPU tests; offline Qwen3-30B-A3B-FP8;
# `profile_steps.py --mode bs1` on Qwen3-8B-FP8, Qwen3-8B and Qwen3-0.6B. Dummy weights.
export PYTHONUNBUFFERED=1
T0=$SECONDS
t() { echo "[$((SECONDS - T0)) s] $*"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
md5sum minisgl/kernels/moe.py minisgl/kernels/moe_align.py
t "align"
timeout 60 python3 benchmark/gpu/bench_moe_align.py
t "MoE GPU tests"
timeout 150 python3 -m pytest -q -m gpu -n 4 --dist loadfile -o addopts="" \
  tests/gpu/test_moe_gpu.py tests/unit/kernels/test_moe.py \
  tests/unit/extensions/quantization/test_fp8_moe.py > $OUT/moe_tests.log 2>&1
tail -3 $OUT/moe_tests.log
t "offline Qwen3-30B-A3B-FP8"
timeout 110 python3 benchmark/offline/bench.py --model benchmark/configs/Qwen3-30B-A3B-FP8 \
  --load-format dummy 2>&1 | grep -E "tok/s|Error" | head -2
for m in Qwen3-8B-FP8 Qwen3-8B Qwen3-0.6B; do
  [ $((SECONDS - T0)) -lt ${LIMIT:-480} ] || { t "skip bs1 $m"; continue; }
  t "bs1 profile $m"
  timeout 120 python3 benchmark/gpu/profile_steps.py --mode bs1 --model benchmark/configs/$m \
    2>&1 | grep -vE "Warning|warn" | tail -20
done
t done
