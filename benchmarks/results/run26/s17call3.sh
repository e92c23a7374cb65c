#!/bin/bash
# session 17 call 3: decode_under_prefill with target_tpot_ms at 3x / 4x the decode floor, token cycles (fused decode steps of the streams between prompt-only invocations)
export PYTHONPATH=$PWD
mkdir -p $OUT/w
L=$OUT/w/call3.log
timeout 470 python -m benchmarks.run --workload decode_under_prefill --mode wavefront --chunk 16 --target-tpot-floor-multiple 3 4 \
  --fused-decode-max-rows 64 --no-plot --out $OUT/w/dup >> $L 2>&1; echo "dup rc=$?" >> $L
grep -E "rc=|decode TPOT|target|cycle" $L | grep -v "%|" | head -20
(cd $OUT/w && tar czf $OUT/all.tgz .)
