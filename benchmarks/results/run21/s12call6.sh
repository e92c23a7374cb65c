#!/bin/bash
# session 12 call 6: engine GPU tests under the new defaults (fused to 128 rows, gated rule); gate rule at c=64/128 fused to 128
export PYTHONPATH=$PWD
timeout 240 python -m pytest -q -m gpu tests/test_gpu_engine.py -x > $OUT/gpu_engine_tests.log 2>&1; echo "tests rc $?" >> $OUT/gpu_engine_tests.log
tail -2 $OUT/gpu_engine_tests.log
timeout 200 python -m benchmarks.decode --context 1024 --concurrency 64 128 --exit ouro0.5 fixed --output-tokens 128 --generate-batch --fused-decode-max-rows 128 --profile-steps 0 --no-plot --out $OUT/decode_rule > $OUT/decode_rule.log 2>&1; echo "rc $?" >> $OUT/decode_rule.log
grep -E "TPOT|rc " $OUT/decode_rule.log
