#!/bin/bash
# Session 14 call 5: decode_matmul=splitk (o_proj/down_proj partials added in the consumer) vs xla:
# tests on the GPU, profile decode:8, decode c=1/8 fixed + ouro0.5
export PYTHONPATH=$PWD
L=$OUT/call5.log
timeout 60 python -m pytest -q -x tests/test_split_k.py -p no:cacheprovider >> $L 2>&1; echo "split_k tests rc=$?" >> $L
for m in xla splitk; do
  timeout 70 python -m benchmarks.profile_step --preset ouro-1.4b --buckets decode:8 --steps 10 --quick-ceilings --no-progress --decode-matmul $m --out $OUT/prof_$m.json >> $L 2>&1
  echo "profile $m rc=$?" >> $L
done
for m in xla splitk; do
  timeout 120 python -m benchmarks.decode --context 1024 --concurrency 1 8 --exit fixed ouro0.5 --output-tokens 128 --fused-decode-max-rows 16 --profile-steps 0 --generate-batch --no-plot --decode-matmul $m --out $OUT/dec_$m >> $L 2>&1
  echo "decode $m rc=$?" >> $L
done
grep -E "rc=|passed|failed|==|TPOT p50" $L | head -40
