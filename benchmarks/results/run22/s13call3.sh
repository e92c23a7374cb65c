#!/bin/bash
# session 13 call 3: decode matvec (XLA norms): probe sweep, GPU correctness, decode bench with the best tuning
export PYTHONPATH=$PWD
timeout 170 python .scratch/matvec_probe.py > $OUT/matvec_probe.log 2>&1; echo "rc $?" >> $OUT/matvec_probe.log
grep -v "Warn\|warn" $OUT/matvec_probe.log | tail -25
(timeout 120 python -m pytest -q -x tests/test_decode_matvec.py -m "slow or not slow" -p no:cacheprovider > $OUT/gpu_tests.log 2>&1; echo "rc $?" >> $OUT/gpu_tests.log)
tail -3 $OUT/gpu_tests.log
BEST=$(cat $OUT/best_tuning 2>/dev/null)
if [ -n "$BEST" ]; then
  OURO_JAX_MATVEC_TUNING=$BEST timeout 240 python -m benchmarks.decode --context 1024 --concurrency 1 8 --exit fixed ouro0.5 --output-tokens 128 --fused-decode-max-rows 16 --decode-matmul fused --profile-steps 0 --out $OUT/fused > $OUT/decode_fused.log 2>&1; echo "rc $?" >> $OUT/decode_fused.log
  grep "TPOT\|ERROR\|rc " $OUT/decode_fused.log | tail -12
fi
