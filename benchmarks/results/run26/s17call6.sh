#!/bin/bash
# session 17 call 6: the split-K Mosaic decode attention alone (XLA GEMMs) against the Triton kernel, c=1 / c=8 fused decode
export PYTHONPATH=$PWD
mkdir -p $OUT/w
for a in auto mgpu_decode; do
  timeout 130 python -m benchmarks.decode --context 1024 --concurrency 1 8 --exit fixed --output-tokens 64 \
    --fused-decode-max-rows 16 --attention $a --generate-batch --profile-steps 0 --out $OUT/w/dec_$a --no-plot > $OUT/w/decode_$a.log 2>&1; echo "decode rc $?" >> $OUT/w/decode_$a.log
  echo "== $a"; grep -E "TPOT|rc" $OUT/w/decode_$a.log | grep -v -i warn | head -4
done
(cd $OUT/w && tar czf $OUT/all.tgz .)
