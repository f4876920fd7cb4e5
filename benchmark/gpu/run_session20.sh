#!/bin/bash
# Prepared in session 19 for the next call (about 9 minutes): the FP8 GEMV's FLAT variant in
# the one-row sweep and Qwen3-8B-FP8 batch 1 with the sweep's table; why cuBLASLt's block-scaled FP8
# GEMM disagreed (probe_scaled_mm.py's layouts and diagnostics, timed where right), the FP8 fused
# MoE's tiles at Qwen3-30B-A3B's shapes, and the offline workload on Qwen3-0.6B, main vs ./base
# (80 GB cards now capture decode graphs up to 256 rows, as the H200 does).
# Run from the repo root on the device: bash benchmark/gpu/run_session20.sh (OUT: a results folder).
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$SECONDS
t() { echo "[$((SECONDS - T0)) s] $*"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t "fp8 gemv sweep (FLAT variant) + 8B-FP8 batch 1"
timeout 150 python3 benchmark/gpu/bench_fp8.py --rows 1 --gemm-rows --write-table $OUT/fp8_gemv.json > $OUT/gemv.log 2>&1
grep "rows 1" $OUT/gemv.log | cut -c1-300
for table in "" "--fp8-gemv-table $OUT/fp8_gemv.json"; do
  timeout 75 python3 benchmark/offline/bench_latency.py --model benchmark/configs/Qwen3-8B-FP8 \
    --load-format dummy $table 2>&1 | grep -iE "ms/token|error" | tail -1
done
t "scaled_mm probe"
timeout 120 python3 benchmark/gpu/probe_scaled_mm.py --rows 64 256 2048 8192 > $OUT/probe.log 2>&1
cut -c1-600 $OUT/probe.log | tail -18
t "fp8 moe tiles"
timeout 150 python3 benchmark/gpu/bench_fp8_moe.py --tokens 1 64 256 2048 > $OUT/moe.log 2>&1
tail -8 $OUT/moe.log
off() {  # label dir
  [ $((SECONDS - T0)) -lt ${LIMIT:-480} ] || { t "skip $1"; return; }
  t "offline Qwen3-0.6B $1"
  (cd $2 && PYTHONPATH=$PWD:${PYTHONPATH#*:} timeout 100 python3 benchmark/offline/bench.py \
    --model benchmark/configs/Qwen3-0.6B --load-format dummy 2>&1 | grep "tok/s" | head -2 | cut -c1-400)
}
off main .
[ -d base ] && off base base
if [ $((SECONDS - T0)) -lt ${LIMIT:-480} ]; then  # the bf16 GEMV's FLAT tiles at 0.6B shapes
  t "bf16 gemv sweep (0.6B, FLAT variant) + 0.6B batch 1 with its table"
  timeout 90 python3 benchmark/gpu/bench_gemv.py --rows 1 --shapes 0.6B --write-table $OUT/gemv.json 2>&1 | tail -5
  for table in "" "--gemv-table $OUT/gemv.json" "" "--gemv-table $OUT/gemv.json"; do
    timeout 40 python3 benchmark/offline/bench_latency.py --model benchmark/configs/Qwen3-0.6B \
      --load-format dummy $table 2>&1 | grep -iE "ms/token|error" | tail -1
  done
fi
t done
