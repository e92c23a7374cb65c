#!/bin/bash
# Session 14 call 4: maintained results with rope_write_kv: decode c=1/8 (fixed, ouro0.5, synthetic2.5,
# generate() b=1/8, kernels per loop), then serve1k and mixed128 for the no-regression check
export PYTHONPATH=$PWD
L=$OUT/call4.log
timeout 300 python -m benchmarks.decode --context 1024 --concurrency 1 8 --exit fixed ouro0.5 synthetic2.5 --output-tokens 128 --fused-decode-max-rows 16 --profile-steps 8 --generate-batch 1 8 --no-plot --out $OUT/decode >> $L 2>&1; echo "decode rc=$?" >> $L
timeout 130 python -m benchmarks.run --workload serve1k --concurrency 128 --exit fixed --no-plot --out $OUT/serve >> $L 2>&1; echo "serve1k rc=$?" >> $L
timeout 120 python -m benchmarks.run --workload mixed128 --mode wavefront --chunk 16 128 --no-plot --out $OUT/mixed >> $L 2>&1; echo "mixed128 rc=$?" >> $L
grep -E "rc=|TPOT p50|out tok/s|prompt tok/s" $L | grep -v "%|" | head -40
