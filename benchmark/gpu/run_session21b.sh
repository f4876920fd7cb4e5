#!/bin/bash
# Session 21, call 2 (about 9 minutes): the GPU suite on the commit, then issue 28's offline
# workloads: Qwen3-8B-FP8 vs Qwen3-8B, Qwen3-30B-A3B-FP8 (FP8 MoE kernels, now the default)
# vs Qwen3-30B-A3B, dummy weights; the dequantized-experts run last if time is left.
# Run from the repo root on the device (OUT: a results folder).
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$SECONDS
t() { echo "[$((SECONDS - T0)) s] $*"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
git log --oneline -1 2>/dev/null
t "GPU suite"
timeout ${SUITE_S:-290} python3 -m pytest -q -m gpu -n 4 --dist loadfile -o addopts="" tests \
  > $OUT/suite.log 2>&1
grep -E "passed|failed|^FAILED|^ERROR" $OUT/suite.log | tail -12
bash benchmark/gpu/run_offline_fp8.sh
t done
