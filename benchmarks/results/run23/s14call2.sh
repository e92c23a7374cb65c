#!/bin/bash
# Session 14 call 2: rope_write_kv on the GPU (tests), then A/B: decode c=1/8 and profile prefill:1024 + decode:8
export PYTHONPATH=$PWD
L=$OUT/call2.log
timeout 170 python -m pytest -q -m gpu -x tests/test_rope_write_kv.py tests/test_gpu_fused_decode.py tests/test_gpu_engine.py -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
echo "gpu tests rc=$?" >> $L
for m in xla kernel; do
  OURO_JAX_ROPE_WRITE=$m timeout 130 python -m benchmarks.decode --context 1024 --concurrency 1 8 --exit fixed ouro0.5 --output-tokens 128 --fused-decode-max-rows 16 --profile-steps 0 --generate-batch --no-plot --out $OUT/dec_$m >> $L 2>&1
  echo "decode $m rc=$?" >> $L
done
for m in xla kernel; do
  OURO_JAX_ROPE_WRITE=$m timeout 90 python -m benchmarks.profile_step --preset ouro-1.4b --buckets prefill:1024 decode:8 --steps 10 --quick-ceilings --no-progress --out $OUT/prof_$m.json >> $L 2>&1
  echo "profile $m rc=$?" >> $L
done
grep -E "rc=|TPOT|passed|failed|wall|fraction" $L | head -40
