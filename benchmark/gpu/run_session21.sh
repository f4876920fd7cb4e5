#!/bin/bash
# Session 21, call 1 (about 9 minutes): torch's block-scaled FP8 GEMM with the recipes named
# (torch.nn.functional.scaled_mm) beside the inferred ones that disagreed; the W8A8 GEMM old
# (./old) vs new (one scale multiply-add a K step); the FP8 GEMV's new one-row default (FLAT,
# R 16) against the W8A8 GEMM's 64-row tiles at one row; Qwen3-8B-FP8 batch 1 old vs new; the
# GPU suite; SiLU-and-mul fused into the FP8 down projection (GEMV and quantizer) vs its own
# kernel. Run from the repo root on the device (OUT: a results folder).
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$SECONDS
t() { echo "[$((SECONDS - T0)) s] $*"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t "scaled_mm probe"
timeout 60 python3 benchmark/gpu/probe_scaled_mm.py --rows 2048 > $OUT/probe.log 2>&1
cut -c1-700 $OUT/probe.log | tail -8
t "W8A8 GEMM (old, new) and cuBLAS"
for d in old .; do
  rows="2048"; [ $d = . ] && rows="16 64 256 $rows"
  (cd $d && PYTHONPATH=$PWD:${PYTHONPATH#*:} timeout $([ $d = . ] && echo 130 || echo 60) python3 benchmark/gpu/bench_fp8.py --rows \
    --gemm-rows $rows $([ $d = . ] && echo --silu --gemm-sweep) 2>&1 | grep -E "GEMM|cuBLASLt|Error" | cut -c1-420)
done
t "fp8 gemv default vs 64-row GEMM, one row"
timeout 60 python3 benchmark/gpu/bench_fp8.py --rows 1 --gemm-rows --gemm-few --no-sweep --silu \
  > $OUT/fp8.log 2>&1
grep -E "rows 1|Error" $OUT/fp8.log | cut -c1-300
lat() {  # dir model [args]
  local d=$1 m=$2; shift 2
  (cd $d && PYTHONPATH=$PWD:${PYTHONPATH#*:} timeout 80 python3 benchmark/offline/bench_latency.py \
    --model benchmark/configs/$m --load-format dummy "$@" 2>&1 | grep -iE "ms/token|error" | tail -1)
}
if [ -z "$LEAN" ]; then  # LEAN=1: a short call keeps the suite
  t "8B-FP8 batch 1, old / new"
  echo "old $(lat old Qwen3-8B-FP8)"; echo "new $(lat . Qwen3-8B-FP8)"
  echo "new, fused_silu_down $(lat . Qwen3-8B-FP8 --engine-arg fused_silu_down=true)"
fi
t "GPU suite"
timeout $((${END:-570} - (SECONDS - T0))) python3 -m pytest -q -m gpu -n 4 --dist loadfile -o addopts="" \
  tests > $OUT/suite.log 2>&1
grep -E "passed|failed|^FAILED|^ERROR" $OUT/suite.log | tail -12
t done
