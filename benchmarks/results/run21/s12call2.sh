#!/bin/bash
# session 12 call 2: the 128-row fused launch (pool big enough for 128 streams), decode c=1/8 with the chunked combine
export PYTHONPATH=$PWD
CS=128 P=256 KV_GB=64 OUT=$OUT timeout 200 python .scratch/fused_block_probe.py > $OUT/fused_block128.log 2>&1; echo "rc $?" >> $OUT/fused_block128.log
grep -v Warn $OUT/fused_block128.log | tail -8
timeout 330 python -m benchmarks.decode --context 1024 --concurrency 1 8 --exit fixed ouro0.5 synthetic2.5 --output-tokens 128 --generate-batch 1 8 --fused-decode-max-rows 16 --profile-steps 0 --out $OUT/decode_combine.json > $OUT/decode_combine.log 2>&1; echo "rc $?" >> $OUT/decode_combine.log
grep -v Warn $OUT/decode_combine.log | tail -30
