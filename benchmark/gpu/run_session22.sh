#!/bin/bash
# Session 22, one short call (about 7 minutes): torch's block-scaled FP8 GEMM with the recipes
# named (the probe); the W8A8 GEMM's tiles swept with cuBLAS beside them and the SiLU-and-mul
# fused into the down projection against its own kernel; the FP8 GEMV's one-row default
# against the W8A8 GEMM's 64-row tiles; the GPU tests of the FP8 paths and the kernels this
# session touched (norm, activation, GEMV). Run from the repo root on the device (OUT: a
# results folder).
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$SECONDS
t() { echo "[$((SECONDS - T0)) s] $*"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t "scaled_mm probe"
timeout 60 python3 benchmark/gpu/probe_scaled_mm.py --rows 2048 > $OUT/probe.log 2>&1
cut -c1-700 $OUT/probe.log | tail -8
t "W8A8 GEMM tiles, cuBLAS, SiLU fused"
timeout 130 python3 benchmark/gpu/bench_fp8.py --rows --gemm-rows 16 64 256 2048 --silu \
  --gemm-sweep 2>&1 | tee $OUT/gemm.log | grep -E "GEMM|cuBLASLt|Error" | cut -c1-420
if [ -z "$SHORT" ]; then  # SHORT=1: a shorter call keeps the tests
  t "fp8 gemv default vs 64-row GEMM, one row"
  timeout 60 python3 benchmark/gpu/bench_fp8.py --rows 1 --gemm-rows --gemm-few --no-sweep --silu \
    > $OUT/fp8.log 2>&1
  grep -E "rows 1|Error" $OUT/fp8.log | cut -c1-300
fi
t "GPU tests: FP8, kernels"
timeout $((${END:-430} - (SECONDS - T0))) python3 -m pytest -q -m gpu -n 4 --dist loadfile \
  -o addopts="" tests/gpu/test_fp8_gpu.py tests/unit/extensions/quantization tests/unit/kernels \
  tests/gpu/test_gpu_engine.py > $OUT/suite.log 2>&1
grep -E "passed|failed|^FAILED|^ERROR" $OUT/suite.log | tail -12
t done
