#!/bin/bash
# H200 session 11 call 7: fused + async decode steps at 32-128 rows (fused_decode_max_rows=128)
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s); el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
el fused128
timeout 420 python -m benchmarks.decode --output-tokens 128 --fused-decode-max-rows 128 --compile-cache /tmp/xla --no-progress --no-plot --generate-batch --profile-steps 0 --context 1024 --concurrency 128 64 32 --exit fixed --time-budget 300 --out $OUT/f128 > $OUT/f128.log 2>&1; grep -E "TPOT|rror|compil" $OUT/f128.log | tail -8
el done
