#!/bin/bash
# Session 21, call 1 (about 9 minutes): the W8A8 GEMM old vs new; torch's block-scaled FP8 GEMM with the recipes named
# (torch.nn.functional.scaled_mm) beside the inferred ones that disagreed; the FP8 GEMV's new
# one-row default (FLAT, R 16) against the W8A8 GEMM's 64-row tiles at one row; the bf16 GEMV's
# FLAT tiles swept cold; batch 1 of Qwen3-8B-FP8 old (./old) vs new, and Qwen3-0.6B with the
# bf16 sweep's table. Run from the repo root on the device (OUT: a results folder).
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$SECONDS
t() { echo "[$((SECONDS - T0)) s] $*"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t "scaled_mm probe"
timeout 80 python3 benchmark/gpu/probe_scaled_mm.py --rows 2048 8192 > $OUT/probe.log 2>&1
cut -c1-700 $OUT/probe.log | tail -16
t "W8A8 GEMM (old ./old, new: one scale multiply-add a K step) and cuBLAS, 256-8192 rows"
for d in old .; do
  rows="256 2048 8192"; [ $d = . ] && rows="16 64 $rows"
  (cd $d && PYTHONPATH=$PWD:${PYTHONPATH#*:} timeout 80 python3 benchmark/gpu/bench_fp8.py --rows \
    --gemm-rows $rows 2>&1 | grep -E "GEMM|cuBLASLt|Error" | cut -c1-260)
done
t "fp8 gemv default vs 64-row GEMM, one row"
timeout 90 python3 benchmark/gpu/bench_fp8.py --rows 1 --gemm-rows --gemm-few --no-sweep \
  > $OUT/fp8.log 2>&1
grep -E "rows 1|True|False" $OUT/fp8.log | cut -c1-300
lat() {  # dir model [args]
  local d=$1 m=$2; shift 2
  (cd $d && PYTHONPATH=$PWD:${PYTHONPATH#*:} timeout 80 python3 benchmark/offline/bench_latency.py \
    --model benchmark/configs/$m --load-format dummy "$@" 2>&1 | grep -iE "ms/token|error" | tail -1)
}
t "8B-FP8 batch 1, old / new x2"
for i in 1 2; do echo "old $(lat old Qwen3-8B-FP8)"; echo "new $(lat . Qwen3-8B-FP8)"; done
t "bf16 gemv FLAT sweep (cold)"
timeout 140 python3 benchmark/gpu/bench_gemv.py --flat-sweep --cold --write-table $OUT/gemv.json \
  > $OUT/gemv.log 2>&1
grep -E "M=1|Error" $OUT/gemv.log | cut -c1-300
if [ -f $OUT/gemv.json ] && [ $((SECONDS - T0)) -lt ${LIMIT:-480} ]; then
  t "0.6B batch 1, default / table x2"
  echo "default $(lat . Qwen3-0.6B)"; echo "table $(lat . Qwen3-0.6B --gemv-table $OUT/gemv.json)"
fi
t done
