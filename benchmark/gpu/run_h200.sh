#!/bin/bash
# The H200 acceptance figures of issues 25 and 28, dummy weights, this tree (and ./base where
# carried). Run from the repo root on the device (about 9 minutes a part).
# PART=25: the offline workload on Qwen3-0.6B, bf16 and fp8_e4m3 KV interleaved twice (also
#   with the tree carried as ./base where there is one, e.g. `git archive af7c41f`); batch 1
#   for Qwen3-0.6B and Qwen3-8B, greedy and at temperature 0.6; the decode-attention sweep.
# PART=28: the offline workload on Qwen3-8B-FP8, Qwen3-8B, Qwen3-30B-A3B-FP8, Qwen3-30B-A3B;
#   batch 1 for Qwen3-8B-FP8, greedy and at temperature 0.6.
# PART=bs1: batch 1, greedy and at temperature 0.6, for each of $MODELS.
# PART=fuse: batch 1 with the defaults beside the batch-1 GEMV fusions switched off
#   (disable_fused_silu_down, disable_fused_norm_gemv, both), interleaved $REPS times
#   (default 3), for each of $MODELS (default Qwen3-0.6B).
# PART=ab: batch 1 (greedy) in this tree and in ./br (a branch from `git archive`), interleaved
#   $REPS times (default 2), for each of $MODELS, with the engine args in $ARGS.
# PART=suite: the GPU suite.
export PYTHONUNBUFFERED=1
T0=$SECONDS
t() { echo "[$((SECONDS - T0)) s] $*"; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader
go() { [ $((SECONDS - T0)) -lt ${LIMIT:-500} ] || { t "skip $*"; return 1; }; }
off() {  # model [engine-arg] [tree]
  go "offline $*" || return
  t "offline $*"
  (cd ${3:-.} && PYTHONPATH=$PWD:$PYTHONPATH timeout 120 python3 benchmark/offline/bench.py \
    --model benchmark/configs/$1 --load-format dummy ${2:+--engine-arg $2} 2>&1 |
    grep -E "tok/s|Error" | head -2)
}
lat() {  # model temperature [engine-arg ...]; in the tree $TREE (default: this one)
  go "batch 1 $*" || return
  local model=$1 temp=$2 args=() a
  shift 2
  for a in "$@"; do args+=(--engine-arg "$a"); done
  echo "batch 1 ${TREE:-.} $model $temp $*: $(cd ${TREE:-.} && PYTHONPATH=$PWD:$PYTHONPATH \
    timeout 90 python3 benchmark/offline/bench_latency.py --model benchmark/configs/$model \
    --load-format dummy --temperature $temp "${args[@]}" 2>&1 | grep -iE "ms/token|error" |
    tail -1)"
}
case ${PART:-25} in
25)
  for i in 1 2; do
    off Qwen3-0.6B; off Qwen3-0.6B kv_cache_dtype=fp8_e4m3
    # The old tree, where carried as ./base (issue 25 compares old and new in one call).
    if [ -d base ]; then off Qwen3-0.6B "" base; off Qwen3-0.6B kv_cache_dtype=fp8_e4m3 base; fi
  done
  for m in Qwen3-0.6B Qwen3-8B; do lat $m 0; lat $m 0.6; done
  go sweep && PYTHONPATH=$PWD:$PYTHONPATH timeout 90 python3 benchmark/gpu/sweep_decode.py \
    --quick 2>&1 | grep -v "^  " ;;
28)
  for m in Qwen3-8B-FP8 Qwen3-8B Qwen3-30B-A3B-FP8 Qwen3-30B-A3B; do off $m; done
  lat Qwen3-8B-FP8 0; lat Qwen3-8B-FP8 0.6 ;;
bs1)
  for m in ${MODELS:-Qwen3-0.6B Qwen3-8B Qwen3-8B-FP8}; do lat $m 0; lat $m 0.6; done ;;
fuse)
  for m in ${MODELS:-Qwen3-0.6B}; do for i in $(seq ${REPS:-3}); do
    lat $m 0; lat $m 0 disable_fused_silu_down=true; lat $m 0 disable_fused_norm_gemv=true
    lat $m 0 disable_fused_silu_down=true disable_fused_norm_gemv=true
  done; done ;;
ab)
  for m in ${MODELS:-Qwen3-0.6B}; do for i in $(seq ${REPS:-2}); do
    # shellcheck disable=SC2086  # ARGS: several engine args, split on purpose
    TREE=. lat $m 0 $ARGS; TREE=br lat $m 0 $ARGS
  done; done ;;
suite)
  t "GPU suite"
  PYTHONPATH=$PWD:$PYTHONPATH timeout ${SUITE_S:-330} python3 -m pytest -q -m gpu -n 4 \
    --dist loadfile -o addopts="" tests > $OUT/suite.log 2>&1
  tail -15 $OUT/suite.log | grep -E "passed|failed|FAILED|Error" ;;
esac
t done
