#!/bin/bash
# session 16 call 3: one-loop step XLA options A/B at prefill buckets (Triton GEMMs off, command buffers off)
export PYTHONPATH=$PWD
for v in default notriton notriton_nocb nocb; do
  case $v in
    default) export OURO_JAX_STEP_XLA_OPTIONS="";;
    notriton) export OURO_JAX_STEP_XLA_OPTIONS="xla_gpu_enable_triton_gemm=false";;
    notriton_nocb) export OURO_JAX_STEP_XLA_OPTIONS="xla_gpu_enable_triton_gemm=false;xla_gpu_enable_command_buffer=";;
    nocb) export OURO_JAX_STEP_XLA_OPTIONS="xla_gpu_enable_command_buffer=";;
  esac
  timeout 140 python -m benchmarks.profile_step --buckets prefill:128 prefill:256 prefill:1024 --quick-ceilings --out $OUT/prof_$v.json > $OUT/prof_$v.log 2>&1; echo "rc $?" >> $OUT/prof_$v.log
  echo "## $v"; grep -E "^==|rc " $OUT/prof_$v.log
done
