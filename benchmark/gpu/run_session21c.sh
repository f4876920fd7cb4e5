#!/bin/bash
# Session 21, a short call (about 4 minutes): the FP8 kernels' native checks (W8A8 GEMM's scale
# modes, FP8 MoE's scalar weight scales, FLAT GEMV default, the cuBLAS route's probe), the
# explicit-recipe probe at 2,048 rows, and the new kernels' times at Qwen3-8B shapes.
# Run from the repo root on the device (OUT: a results folder).
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$SECONDS
t() { echo "[$((SECONDS - T0)) s] $*"; }
nvidia-smi --query-gpu=name --format=csv,noheader
t "native checks"
timeout 110 python3 -m pytest -q -m gpu -o addopts="" -p no:cacheprovider \
  tests/unit/extensions/quantization/test_fp8_kernels.py tests/unit/extensions/quantization/test_fp8_moe.py \
  tests/unit/kernels/test_moe.py tests/gpu/test_fp8_gpu.py > $OUT/checks.log 2>&1
grep -E "passed|failed|^FAILED|^ERROR|Error" $OUT/checks.log | tail -8
t "scaled_mm probe"
timeout 45 python3 benchmark/gpu/probe_scaled_mm.py --rows 2048 > $OUT/probe.log 2>&1
cut -c1-600 $OUT/probe.log | tail -7
t "FP8 GEMV default, W8A8 GEMM, cuBLAS"
timeout 60 python3 benchmark/gpu/bench_fp8.py --rows 1 --gemm-rows 256 2048 --no-sweep \
  2>&1 | grep -E "rows|cuBLASLt|Error" | cut -c1-260
t done
