#!/bin/bash
# session 13 call 5: command-buffer update mode SKIP_TEMP for fused steps: GPU fused-decode tests under it, then c=1/8 early exit A/B
export PYTHONPATH=$PWD
SK="xla_gpu_command_buffer_update_mode=SKIP_TEMP"
(OURO_JAX_FUSED_XLA_OPTIONS=$SK timeout 140 python -m pytest -q -x tests/test_gpu_fused_decode.py -m gpu -p no:cacheprovider > $OUT/gpu_fused_skip_temp.log 2>&1; echo "rc $?" >> $OUT/gpu_fused_skip_temp.log)
tail -3 $OUT/gpu_fused_skip_temp.log
B="python -m benchmarks.decode --context 1024 --concurrency 1 8 --exit ouro0.5 --output-tokens 128 --fused-decode-max-rows 16 --profile-steps 0 --generate-batch"
timeout 100 $B --out $OUT/ab_default > $OUT/ab_default.log 2>&1; echo "rc $?" >> $OUT/ab_default.log
grep "TPOT\|ERROR\|rc " $OUT/ab_default.log | tail -3
OURO_JAX_FUSED_XLA_OPTIONS=$SK timeout 100 $B --out $OUT/ab_skip_temp > $OUT/ab_skip_temp.log 2>&1; echo "rc $?" >> $OUT/ab_skip_temp.log
grep "TPOT\|ERROR\|rc " $OUT/ab_skip_temp.log | tail -3
