#!/bin/bash
# session 12 call 1: GPU tests of the chunked combine, the 128-row fused launch probe, decode attention knobs
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt
timeout 150 python -m pytest -q -m gpu tests/test_pallas_attention.py -x > $OUT/gpu_attn_tests.log 2>&1; echo "tests rc $?" >> $OUT/gpu_attn_tests.log
TUNE="0,0,0,0;0,0,0,0,1;0,64,256,0;0,64,64,0;0,32,128,0;0,64,128,1024;1,32,128,0" timeout 260 python .scratch/attn_tune_probe.py > $OUT/attn_tune.log 2>&1; echo "rc $?" >> $OUT/attn_tune.log
OUT=$OUT timeout 170 python .scratch/fused_block_probe.py > $OUT/fused_block.log 2>&1; echo "rc $?" >> $OUT/fused_block.log
tail -3 $OUT/gpu_attn_tests.log; grep -v Warn $OUT/attn_tune.log | tail -16; grep -v Warn $OUT/fused_block.log | tail -20
