#!/bin/bash
# session 16 call 5: is the bf16 mgpu-vs-triton token flip a near-tie of the new cuBLAS GEMMs? (Triton GEMMs forced back; other prompt seeds)
export PYTHONPATH=$PWD
OURO_JAX_STEP_XLA_OPTIONS="xla_gpu_enable_triton_gemm=true" timeout 120 python -m pytest -q -m gpu tests/test_gpu_engine.py -k mosaic_kernel_engine > $OUT/triton_gemm.log 2>&1; echo "rc $?" >> $OUT/triton_gemm.log
tail -2 $OUT/triton_gemm.log
timeout 300 python -m pytest -q -m gpu .scratch/test_seed_probe.py -p no:cacheprovider > $OUT/seeds.log 2>&1; echo "rc $?" >> $OUT/seeds.log
grep -E "^E .*kernel:|passed|failed|rc " $OUT/seeds.log | tail -8
