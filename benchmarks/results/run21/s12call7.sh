#!/bin/bash
# session 12 call 7: serve1k c=128 fixed, fused to 8 rows vs to 128 rows, one call
export PYTHONPATH=$PWD
for rows in 8 128; do
timeout 200 python -m benchmarks.run --workload serve1k --concurrency 128 --exit fixed --fused-decode-max-rows $rows --generate-baseline --out $OUT/serve1k_f$rows > $OUT/serve1k_f$rows.log 2>&1; echo "rc $?" >> $OUT/serve1k_f$rows.log
grep -v Warn $OUT/serve1k_f$rows.log | grep -E "^serve1k.*tok/s|rc " | tail -2
done
