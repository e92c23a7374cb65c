#!/bin/bash
# session 17 call 5: GPU tests of the fused decode programs after the elastic removal (independent program simplified)
export PYTHONPATH=$PWD
mkdir -p $OUT/w
timeout 420 python -m pytest -q -m gpu tests/test_gpu_fused_decode.py > $OUT/w/gpu_fused.log 2>&1; echo "rc $?" >> $OUT/w/gpu_fused.log
tail -5 $OUT/w/gpu_fused.log
