#!/bin/bash
# session 13 call 2: fused norm+matvec decode layers: GPU correctness, probe, decode bench
export PYTHONPATH=$PWD
(timeout 150 python -m pytest -q -x tests/test_decode_matvec.py -m "slow or not slow" -p no:cacheprovider > $OUT/gpu_tests.log 2>&1; echo "rc $?" >> $OUT/gpu_tests.log) 
tail -5 $OUT/gpu_tests.log
NVAR=3 timeout 150 python .scratch/matvec_probe.py > $OUT/matvec_probe.log 2>&1; echo "rc $?" >> $OUT/matvec_probe.log
grep -v "Warn\|warn" $OUT/matvec_probe.log | tail -12
timeout 250 python -m benchmarks.decode --context 1024 --concurrency 1 8 --exit fixed ouro0.5 --output-tokens 128 --fused-decode-max-rows 16 --decode-matmul fused --profile-steps 0 --out $OUT/fused > $OUT/decode_fused.log 2>&1; echo "rc $?" >> $OUT/decode_fused.log
grep -v "Warn\|warn" $OUT/decode_fused.log | tail -25
