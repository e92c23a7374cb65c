#!/bin/bash
# Session 14 call 3: rope_write_kv tuning alone; residual-barrier probe (prefill:1024, decode:8);
# GPU engine tests; long4 wavefront chunk 64/128 with the kernel
export PYTHONPATH=$PWD
L=$OUT/call3.log
timeout 100 python .scratch/rwk_tune.py >> $L 2>&1; echo "rwk_tune rc=$?" >> $L
for b in none entry both; do
  BARRIER=$([ $b = none ] && echo "" || echo $b) timeout 75 python .scratch/barrier_probe.py --preset ouro-1.4b --buckets prefill:1024 decode:8 --steps 10 --quick-ceilings --no-progress --out $OUT/prof_$b.json >> $L 2>&1
  echo "barrier $b rc=$?" >> $L
done
timeout 150 python -m pytest -q -m gpu -x tests/test_gpu_engine.py -p no:cacheprovider > $OUT/gpu_engine.log 2>&1; echo "gpu engine rc=$?" >> $L
timeout 150 python -m benchmarks.run --workload long4 --mode wavefront --chunk 64 128 --no-plot --out $OUT/long4 >> $L 2>&1; echo "long4 rc=$?" >> $L
grep -E "rc=|us a call|==|passed|failed|prompt tok/s|wavefront" $L | head -60
