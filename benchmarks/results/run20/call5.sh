#!/bin/bash
# H200 session 11 call 5: figures of the async fused steps (decode records, sync A/B twice, serve1k)
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s); el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( 540 - ($(date +%s) - T0) )); }
D="python -m benchmarks.decode --context 1024 --output-tokens 128 --fused-decode-max-rows 16 --compile-cache /tmp/xla --no-progress --no-plot"
el decode async
timeout 230 $D --concurrency 1 8 --exit fixed ouro0.5 synthetic2.5 --generate-batch 1 8 --out $OUT/decode > $OUT/decode.log 2>&1; grep -E "TPOT|rror" $OUT/decode.log | tail -12
el decode sync
timeout 80 $D --concurrency 1 8 --exit fixed ouro0.5 --generate-batch --profile-steps 0 --no-async-scheduling --out $OUT/decode_sync > $OUT/decode_sync.log 2>&1; grep -E "TPOT|rror" $OUT/decode_sync.log | tail -4
el decode async again
timeout 60 $D --concurrency 1 8 --exit fixed ouro0.5 --generate-batch --profile-steps 0 --out $OUT/decode_async2 > $OUT/decode_async2.log 2>&1; grep -E "TPOT|rror" $OUT/decode_async2.log | tail -4
el serve1k
L=$(left); timeout $L python -m benchmarks.run --workload serve1k --concurrency 1 128 --exit fixed --fused-decode-max-rows 8 --out $OUT/serve1k --compile-cache /tmp/xla2 --no-progress --no-plot > $OUT/serve1k.log 2>&1; grep -E "^serve1k|rror" $OUT/serve1k.log | tail -4
el done
