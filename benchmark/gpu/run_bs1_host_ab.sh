#!/bin/bash
# Batch-1 A/B of branch bs1-host (decode tiles for 1-4 rows, the chunks of split decode rows
# combined in the split kernel, the page table's updates in the step's one staged copy,
# cheaper event records) against this tree (main). Carry the branch as `br/`:
#   rm -rf br && mkdir br && git archive bs1-host | tar -x -C br   (br/ in .git/info/exclude)
# and run it from the root of main: `LIMIT=500 PART=a bash br/benchmark/gpu/run_bs1_host_ab.sh`.
# PART=a (about 9 minutes): the branch's GPU checks of what it changes; bench_decode_bs1.py
#   (tiles x reduction kernel / in-kernel combine, batches 1, 2, 4); batch 1 on Qwen3-8B and
#   Qwen3-0.6B, main / branch interleaved twice; host_bs1.py --parts (0.6B) on both; the
#   branch at 8B with each opt-in batch-1 fusion.
# PART=b: the GPU suite on the branch; the offline workload (Qwen3-0.6B) main / branch.
export PYTHONUNBUFFERED=1
T0=$SECONDS
t() { echo "[$((SECONDS - T0)) s] $*"; }
go() { [ $((SECONDS - T0)) -lt ${LIMIT:-500} ] || { t "skip $*"; return 1; }; }
in_tree() { (cd $1 && shift && PYTHONPATH=$PWD:$PYTHONPATH "$@"); }
nvidia-smi --query-gpu=name --format=csv,noheader
case ${PART:-a} in
a)
  t "branch GPU checks"
  in_tree br timeout 200 python3 -m pytest -q -m gpu -n 4 --dist loadfile -o addopts="" \
    -p no:benchmark tests/gpu/test_decode_combine_gpu.py tests/gpu/test_staging_gpu.py \
    tests/unit/attention/test_triton_backend.py tests/gpu/test_gpu_engine.py \
    -k "not hf and not structured" > $OUT/checks.log 2>&1
  grep -E "passed|failed|FAILED|Error" $OUT/checks.log | tail -6
  go decode && in_tree br timeout 90 python3 benchmark/gpu/bench_decode_bs1.py \
    --contexts 200 1000 --batches 1 2 4 2>&1 | grep -E "Hq|Error"
  lat() {  # tree model [engine-arg]
    go "$*" && echo "$2 $1 $3: $(in_tree $1 timeout 70 python3 \
      benchmark/offline/bench_latency.py --model benchmark/configs/$2 --load-format dummy \
      ${3:+--engine-arg $3} 2>&1 | grep -iE "ms/token|error" | tail -1)"
  }
  for m in Qwen3-8B Qwen3-0.6B; do for tree in . br . br; do lat $tree $m; done; done
  for tree in . br; do
    go "host $tree" && echo "host $tree: $(in_tree $tree timeout 60 python3 \
      benchmark/offline/host_bs1.py --model benchmark/configs/Qwen3-0.6B --load-format dummy \
      --parts 2>&1 | grep -E "steps|us/step|Error" | head -12)"
  done
  # The opt-in batch-1 fusions on top of the branch, at 8B (GPU-bound at batch 1).
  lat br Qwen3-8B fused_silu_down=true; lat br Qwen3-8B fused_norm_gemv=true ;;
b)
  t "GPU suite on br"
  in_tree br timeout ${SUITE_S:-330} python3 -m pytest -q -m gpu -n 4 --dist loadfile \
    -o addopts="" -p no:benchmark tests > $OUT/suite.log 2>&1
  grep -E "passed|failed|FAILED" $OUT/suite.log | tail -8
  for tree in . br; do
    go "offline $tree" && in_tree $tree timeout 100 python3 benchmark/offline/bench.py \
      --model benchmark/configs/Qwen3-0.6B --load-format dummy 2>&1 | grep -E "tok/s|Error"
  done ;;
esac
t done
