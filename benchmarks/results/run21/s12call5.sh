#!/bin/bash
# session 12 call 5: the 128-row sampling test; early exit at c=32/128 fused to 128 rows vs 16; serve1k c=128 fused 128
export PYTHONPATH=$PWD
timeout 120 python -m pytest -q -m gpu tests/test_gpu_fused_decode.py -k xla_sort > $OUT/gpu_sort_test.log 2>&1; echo "tests rc $?" >> $OUT/gpu_sort_test.log
tail -2 $OUT/gpu_sort_test.log
for rows in 128 16; do
timeout 150 python -m benchmarks.decode --context 1024 --concurrency 32 128 --exit ouro0.5 synthetic2.5 --output-tokens 128 --generate-batch --fused-decode-max-rows $rows --profile-steps 0 --no-plot --out $OUT/decode_early$rows > $OUT/decode_early$rows.log 2>&1; echo "rc $?" >> $OUT/decode_early$rows.log
grep -E "TPOT|rc " $OUT/decode_early$rows.log
done
timeout 170 python -m benchmarks.run --workload serve1k --concurrency 128 --exit fixed --fused-decode-max-rows 128 --out $OUT/serve1k > $OUT/serve1k.log 2>&1; echo "rc $?" >> $OUT/serve1k.log
grep -v Warn $OUT/serve1k.log | grep -iE "tok/s|rc |TPOT" | tail -5
