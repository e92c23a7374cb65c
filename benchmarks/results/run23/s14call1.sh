#!/bin/bash
# Session 14 call 1: kernel sequences + HLO (decode c=1/8 fused, prefill:1024), then decode c=1/8
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt 2>&1
timeout 240 python .scratch/seq_probe.py > $OUT/seq_probe.log 2>&1
echo "seq_probe rc=$?" >> $OUT/seq_probe.log
timeout 300 python -m benchmarks.decode --context 1024 --concurrency 1 8 --exit fixed ouro0.5 --output-tokens 128 --fused-decode-max-rows 16 --profile-steps 0 --generate-batch --no-plot --out $OUT/decode > $OUT/decode.log 2>&1
echo "decode rc=$?" >> $OUT/decode.log
tail -5 $OUT/seq_probe.log $OUT/decode.log
