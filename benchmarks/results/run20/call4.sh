#!/bin/bash
# H200 session 11 call 4: is the async c=1 early-exit regression (4.11 -> 5.21 ms) from WHILE command buffers?
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s); el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
for v in async sync; do
  el nocb $v
  F=""; [ $v = sync ] && F=--no-async-scheduling
  timeout 150 python .scratch/decode_nocb.py --context 1024 --concurrency 1 8 --exit fixed ouro0.5 --output-tokens 64 --generate-batch --profile-steps 0 --fused-decode-max-rows 16 $F --out $OUT/nocb_$v --compile-cache /tmp/xla --no-progress --no-plot > $OUT/nocb_$v.log 2>&1; grep -E "TPOT|rror" $OUT/nocb_$v.log | tail -8
done
el async with WHILE, profiled c=1 ouro0.5
timeout 150 python -m benchmarks.decode --context 1024 --concurrency 1 --exit ouro0.5 --output-tokens 64 --generate-batch --profile-steps 4 --fused-decode-max-rows 16 --out $OUT/cb_async_prof --compile-cache /tmp/xla --no-progress --no-plot > $OUT/cb_async_prof.log 2>&1; grep -E "TPOT|rror" $OUT/cb_async_prof.log | tail -4
el done
