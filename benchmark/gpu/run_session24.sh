#!/bin/bash
# Where batch-1 decode's time goes (issue 28's 8B-FP8 target): `profile_steps.py --mode bs1` on
# Qwen3-8B-FP8, Qwen3-8B and Qwen3-0.6B, dummy weights. Run from the repo root on the device.
# (The alignment's expert-major counts, branch moe-align-expert-major: run_moe_align_ab.sh.)
export PYTHONUNBUFFERED=1
T0=$SECONDS
t() { echo "[$((SECONDS - T0)) s] $*"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for m in Qwen3-8B-FP8 Qwen3-8B Qwen3-0.6B; do
  [ $((SECONDS - T0)) -lt ${LIMIT:-480} ] || { t "skip bs1 $m"; continue; }
  t "bs1 profile $m"
  PYTHONPATH=$PWD:$PYTHONPATH timeout 120 python3 benchmark/gpu/profile_steps.py --mode bs1 \
    --model benchmark/configs/$m 2>&1 | grep -vE "Warning|warn" | tail -20
done
t done
