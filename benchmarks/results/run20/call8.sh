#!/bin/bash
# H200 session 11 call 8: why a 128-row fused step is slower than 128-row one-loop steps (profiles; fused without graph conditionals so its kernels show)
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s); el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
A="--output-tokens 32 --compile-cache /tmp/xla --no-progress --no-plot --generate-batch --profile-steps 4 --context 1024 --concurrency 128 --exit fixed"
el fused nocb
timeout 200 python .scratch/decode_nocb.py $A --fused-decode-max-rows 128 --out $OUT/f128_nocb > $OUT/f128_nocb.log 2>&1; grep -E "TPOT|rror" $OUT/f128_nocb.log | tail -3
el loop by loop
timeout 150 python -m benchmarks.decode $A --fused-decode-max-rows 0 --out $OUT/lbl > $OUT/lbl.log 2>&1; grep -E "TPOT|rror" $OUT/lbl.log | tail -3
el done
