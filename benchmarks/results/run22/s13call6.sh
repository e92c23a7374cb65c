#!/bin/bash
# session 13 call 6: the engine end to end, decode_matmul fused (default tuning 32,256,4,4) against xla, c=1/8 fixed
export PYTHONPATH=$PWD
B="python -m benchmarks.decode --context 1024 --concurrency 1 8 --exit fixed --output-tokens 128 --fused-decode-max-rows 16 --profile-steps 0 --generate-batch"
timeout 110 $B --out $OUT/e2e_xla > $OUT/e2e_xla.log 2>&1; echo "rc $?" >> $OUT/e2e_xla.log
grep "TPOT\|ERROR\|rc " $OUT/e2e_xla.log | tail -3
timeout 120 $B --decode-matmul fused --out $OUT/e2e_fused > $OUT/e2e_fused.log 2>&1; echo "rc $?" >> $OUT/e2e_fused.log
grep "TPOT\|ERROR\|rc " $OUT/e2e_fused.log | tail -3
