#!/bin/bash
# session 16 call 1: GPU tests of the independent / elastic fused programs, then decode A/B of the row programs
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt
timeout 170 python -m pytest -q -m gpu tests/test_gpu_fused_decode.py -k "independent or elastic" -x > $OUT/gpu_tests.log 2>&1; echo "tests rc $?" >> $OUT/gpu_tests.log
tail -5 $OUT/gpu_tests.log
timeout 380 python -m benchmarks.decode --context 1024 --concurrency 1 8 --exit fixed ouro0.5 --output-tokens 128 \
  --fused-decode-max-rows 16 --fused-decode-tokens 8 --fused-decode-rows lockstep independent elastic \
  --profile-steps 0 --out $OUT/dec --no-plot --time-budget 360 > $OUT/decode.log 2>&1; echo "decode rc $?" >> $OUT/decode.log
grep -v -i warn $OUT/decode.log | tail -25
