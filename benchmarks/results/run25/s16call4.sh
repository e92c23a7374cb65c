#!/bin/bash
# session 16 call 4: cuBLAS GEMMs at >= 128-row one-loop steps: profile (full ceilings), long4, mixed128, GPU engine tests
export PYTHONPATH=$PWD
timeout 170 python -m benchmarks.profile_step --buckets prefill:1024 prefill:2048 decode:8 --out $OUT/profile_step.json > $OUT/prof.log 2>&1; echo "rc $?" >> $OUT/prof.log
grep -E "^==|rc " $OUT/prof.log
timeout 150 python -m benchmarks.run --workload long4 --mode wavefront --chunk 64 128 --out $OUT/run > $OUT/long4.log 2>&1; echo "rc $?" >> $OUT/long4.log
grep -v -i warn $OUT/long4.log | grep -E "tok/s|floor|rc " | tail -6
timeout 120 python -m benchmarks.run --workload mixed128 --mode wavefront --chunk 16 128 --out $OUT/run > $OUT/mixed128.log 2>&1; echo "rc $?" >> $OUT/mixed128.log
grep -v -i warn $OUT/mixed128.log | grep -E "tok/s|floor|rc " | tail -6
timeout 130 python -m pytest -q -m gpu tests/test_gpu_engine.py -x > $OUT/gpu_tests.log 2>&1; echo "tests rc $?" >> $OUT/gpu_tests.log
tail -3 $OUT/gpu_tests.log
