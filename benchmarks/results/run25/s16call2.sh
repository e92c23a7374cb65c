#!/bin/bash
# session 16 call 2: generate() in CUDA graphs (GPU tests, then decode A/B), prefill:1024 with XLA's Triton GEMMs off
export PYTHONPATH=$PWD
timeout 200 python -m pytest -q -m gpu tests/test_gpu_fused_decode.py tests/test_gpu_engine.py -k "generate" -x > $OUT/gpu_tests.log 2>&1; echo "tests rc $?" >> $OUT/gpu_tests.log
tail -3 $OUT/gpu_tests.log
timeout 200 python -m benchmarks.decode --context 1024 --concurrency 8 --exit fixed ouro0.5 --output-tokens 128 \
  --fused-decode-max-rows 16 --generate-batch 1 8 --profile-steps 0 --out $OUT/dec --no-plot > $OUT/decode.log 2>&1; echo "decode rc $?" >> $OUT/decode.log
grep -E "TPOT|rc" $OUT/decode.log
for v in default notriton; do
  if [ $v = notriton ]; then export OURO_JAX_STEP_XLA_OPTIONS="xla_gpu_enable_triton_gemm=false"; fi
  timeout 150 python -m benchmarks.profile_step --buckets prefill:1024 --quick-ceilings --out $OUT/prof_$v.json > $OUT/prof_$v.log 2>&1; echo "rc $?" >> $OUT/prof_$v.log
  grep -E "^==|ms|rc" $OUT/prof_$v.log | grep -v -i warn | head -12
done
