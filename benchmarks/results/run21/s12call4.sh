#!/bin/bash
# session 12 call 4: fused steps without CUB sort: GPU tests, then decode c=16..128 fused up to 128 rows vs 16
export PYTHONPATH=$PWD
timeout 200 python -m pytest -q -m gpu tests/test_gpu_fused_decode.py -x > $OUT/gpu_fused_tests.log 2>&1; echo "tests rc $?" >> $OUT/gpu_fused_tests.log
tail -3 $OUT/gpu_fused_tests.log
for rows in 128 16; do
timeout 170 python -m benchmarks.decode --context 1024 --concurrency 16 32 64 128 --exit fixed --output-tokens 128 --generate-batch --fused-decode-max-rows $rows --profile-steps 0 --no-plot --out $OUT/decode_fused$rows > $OUT/decode_fused$rows.log 2>&1; echo "rc $?" >> $OUT/decode_fused$rows.log
grep -E "TPOT|rc " $OUT/decode_fused$rows.log
done
