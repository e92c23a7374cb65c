#!/bin/bash
# H200 session 11 call 3: async fused steps + WHILE command buffers: GPU tests, then decode A/B (async vs sync)
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s); el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
el gpu tests
timeout 250 python -m pytest -q -m gpu tests/test_gpu_engine.py tests/test_gpu_fused_decode.py -p no:cacheprovider -x 2>&1 | grep -vi "warn" | tail -6 | tee $OUT/gpu_tests.log
for v in async sync; do
  el decode $v
  F=""; [ $v = sync ] && F=--no-async-scheduling
  timeout 140 python -m benchmarks.decode --context 1024 --concurrency 1 8 --exit fixed ouro0.5 --output-tokens 64 --generate-batch $([ $v = async ] && echo 1) --profile-steps 0 --fused-decode-max-rows 16 $F --out $OUT/dec_$v --compile-cache /tmp/xla --no-progress --no-plot > $OUT/dec_$v.log 2>&1; grep -E "TPOT|rror" $OUT/dec_$v.log | tail -8
done
el done
