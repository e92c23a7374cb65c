#!/bin/bash
# session 16 call 7: lockstep vs independent rows at c=8 with synthetic depths (2.5 loops a token, high spread)
export PYTHONPATH=$PWD
timeout 200 python -m benchmarks.decode --context 1024 --concurrency 8 --exit synthetic2.5 --output-tokens 128 \
  --fused-decode-max-rows 16 --fused-decode-tokens 8 --fused-decode-rows lockstep independent \
  --profile-steps 0 --out $OUT/dec --no-plot > $OUT/decode.log 2>&1; echo "decode rc $?" >> $OUT/decode.log
grep -E "TPOT|rc" $OUT/decode.log
