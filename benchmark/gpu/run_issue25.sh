#!/bin/bash
# Issue 25 (kernel part), one device call: tests of the fp8 attention paths natively, the
# abort-under-overlap torch case 3x, the decode sweep (new tree, then base), the offline
# workload old/new x bf16/fp8 (fp8 modes 1, 2, 0). Run from the new tree's root with the
# base tree (main before the change) in ./base, e.g. from the main checkout:
#   git -C WT archive HEAD | tar -x -C .wt25; git archive MAIN | tar -x -C .wt25/base
#   run: <wheel install>; cd .wt25 && bash benchmark/gpu/run_issue25.sh   (about 450 s)
# Logs under $OUT: tests.log, sweep_new.log/.json, sweep_base.log, off.log.
export PYTHONUNBUFFERED=1
NEW=$PWD; BASE=$PWD/base; SITE=$PYTHONPATH
T0=$SECONDS
t() { echo "[$((SECONDS - T0)) s] $*"; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
t tests
PYTHONPATH=$NEW:$SITE timeout 150 python3 -m pytest -q -o addopts="" -p no:cacheprovider \
  -n 4 --dist loadfile tests/unit/attention/test_triton_backend.py \
  tests/unit/kernels/test_qk_rope_store.py tests/gpu/test_fp8_kv_gpu.py \
  tests/gpu/test_abort_overlap_gpu.py tests/gpu/test_gpu_engine.py -rfE > $OUT/tests.log 2>&1
grep -E "passed|failed|FAILED|ERROR" $OUT/tests.log | tail -8
ABORT="tests/gpu/test_abort_overlap_gpu.py::test_aborts_under_overlap_graphs_and_a_lagging_device[torch]"
for i in 2 3; do
  t "abort torch run $i"
  PYTHONPATH=$NEW:$SITE timeout 50 python3 -m pytest -q -o addopts="" -p no:cacheprovider "$ABORT" -rfE 2>&1 | tail -1
done
t sweep new
MINISGL_FP8_KV_MODE=1 PYTHONPATH=$NEW:$SITE timeout 150 python3 benchmark/gpu/sweep_decode.py --out $OUT/sweep_new.json > $OUT/sweep_new.log 2>&1
grep -v "^  " $OUT/sweep_new.log; grep -c "^  " $OUT/sweep_new.log
t sweep base
cp benchmark/gpu/sweep_decode.py $BASE/benchmark/gpu/sweep_decode25.py
(cd $BASE && PYTHONPATH=$BASE:$SITE timeout 60 python3 benchmark/gpu/sweep_decode25.py --quick > $OUT/sweep_base.log 2>&1)
grep -v "^  " $OUT/sweep_base.log
offline() {  # tree kv [env]
  t "offline $1 $2 $3"
  (cd $1 && env $3 PYTHONPATH=$1:$SITE timeout 60 python3 benchmark/offline/bench.py \
    --model benchmark/configs/Qwen3-0.6B --load-format dummy --engine-arg kv_cache_dtype=$2 \
    > /tmp/off.log 2>&1; echo "== $1 $2 $3" >> $OUT/off.log; cat /tmp/off.log >> $OUT/off.log
    grep "tok/s" /tmp/off.log | head -1; grep -E "Error|error" /tmp/off.log | tail -2)
}
offline $BASE auto; offline $NEW auto; offline $BASE fp8_e4m3
offline $NEW fp8_e4m3 MINISGL_FP8_KV_MODE=1
[ $((SECONDS - T0)) -lt 400 ] && offline $NEW fp8_e4m3 MINISGL_FP8_KV_MODE=2
[ $((SECONDS - T0)) -lt 420 ] && offline $NEW fp8_e4m3
t done
