#!/bin/bash
# Session 21, call 2 (about 9 minutes): issue 28's offline workloads (Qwen3-8B-FP8 vs Qwen3-8B,
# Qwen3-30B-A3B-FP8 with the FP8 MoE kernels, now the default, vs Qwen3-30B-A3B; dummy weights),
# then the bf16 GEMV's FLAT tiles swept cold and Qwen3-0.6B batch 1 with the sweep's table.
# Run from the repo root on the device (OUT: a results folder).
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$SECONDS
t() { echo "[$((SECONDS - T0)) s] $*"; }
LIMIT=${OFF_LIMIT:-440} bash benchmark/gpu/run_offline_fp8.sh
if [ $((SECONDS - T0)) -lt ${LIMIT:-420} ]; then
  t "bf16 gemv FLAT sweep (cold)"
  timeout 100 python3 benchmark/gpu/bench_gemv.py --flat-sweep --cold --write-table $OUT/gemv.json \
    > $OUT/gemv.log 2>&1
  grep -E "M=1|Error" $OUT/gemv.log | cut -c1-300
  for table in "" "--gemv-table $OUT/gemv.json"; do
    [ -f $OUT/gemv.json ] || break
    timeout 40 python3 benchmark/offline/bench_latency.py --model benchmark/configs/Qwen3-0.6B \
      --load-format dummy $table 2>&1 | grep -iE "ms/token|error" | tail -1
  done
fi
t done
