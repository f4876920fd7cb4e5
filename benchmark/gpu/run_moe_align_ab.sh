#!/bin/bash
# A/B of a branch of the MoE alignment (moe-align-triton, merged in 171da4f; now
# moe-align-expert-major: the chunk counts expert-major)
# against this tree. Carry the branch as `br/`:
#   rm -rf br && mkdir br && git archive moe-align-expert-major | tar -x -C br   (br/ in .git/info/exclude)
# Then on the device: the MoE GPU tests on the branch, bench_moe_align.py on both trees, and
# the offline workload on Qwen3-30B-A3B-FP8 and Qwen3-30B-A3B, main then branch, twice.
export PYTHONUNBUFFERED=1
T0=$SECONDS
t() { echo "[$((SECONDS - T0)) s] $*"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for tree in . br; do
  t "align $tree"
  (cd $tree && PYTHONPATH=$PWD:$PYTHONPATH timeout 60 python3 benchmark/gpu/bench_moe_align.py)
done
t "MoE GPU tests on br"
(cd br && PYTHONPATH=$PWD:$PYTHONPATH timeout 150 python3 -m pytest -q -m gpu -n 4 \
  --dist loadfile -o addopts="" tests/gpu/test_moe_gpu.py tests/unit/kernels/test_moe.py \
  tests/unit/extensions/quantization/test_fp8_moe.py > $OUT/moe_tests.log 2>&1)
tail -3 $OUT/moe_tests.log
for model in Qwen3-30B-A3B-FP8 Qwen3-30B-A3B; do
  for tree in . br . br; do
    [ $((SECONDS - T0)) -lt ${LIMIT:-480} ] || { t "skip $model $tree"; continue; }
    t "offline $model $tree"
    (cd $tree && PYTHONPATH=$PWD:$PYTHONPATH timeout 110 python3 benchmark/offline/bench.py \
      --model benchmark/configs/$model --load-format dummy 2>&1 | grep -E "tok/s|Error" | head -2)
  done
done
t done
