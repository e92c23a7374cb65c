#!/bin/bash
# H200 session 11 call 6: decode records at more concurrencies and 4K context with async fused steps
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s); el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
D="python -m benchmarks.decode --output-tokens 128 --fused-decode-max-rows 16 --compile-cache /tmp/xla --no-progress --no-plot --generate-batch --profile-steps 0"
el 1k
timeout 200 $D --context 1024 --concurrency 2 4 16 --exit fixed ouro0.5 --out $OUT/d1k > $OUT/d1k.log 2>&1; grep -E "TPOT|rror" $OUT/d1k.log | tail -8
el 4k
timeout 200 $D --context 4096 --concurrency 1 8 --exit fixed --out $OUT/d4k > $OUT/d4k.log 2>&1; grep -E "TPOT|rror" $OUT/d4k.log | tail -4
el done
