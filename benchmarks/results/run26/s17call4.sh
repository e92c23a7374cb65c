#!/bin/bash
# session 17 call 4: the fused step's row programs at synthetic depths (mean 2.5 loops), elastic included, one call
export PYTHONPATH=$PWD
mkdir -p $OUT/w
timeout 300 python -m benchmarks.decode --context 1024 --concurrency 8 --exit synthetic2.5 --output-tokens 128 \
  --fused-decode-max-rows 16 --fused-decode-tokens 8 --fused-decode-rows lockstep independent elastic --generate-batch --profile-steps 0 --out $OUT/w/dec --no-plot > $OUT/w/decode.log 2>&1; echo "decode rc $?" >> $OUT/w/decode.log
grep -E "TPOT|rc" $OUT/w/decode.log | grep -v -i warn | head -8
(cd $OUT/w && tar czf $OUT/all.tgz .)
