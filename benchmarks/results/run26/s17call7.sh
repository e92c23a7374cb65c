#!/bin/bash
# session 17 call 7: XLA's Triton GEMMs with warp specialization in prompt-sized one-loop steps (A/B, profile_step)
export PYTHONPATH=$PWD
mkdir -p $OUT/w
for v in default ws; do
  unset OURO_JAX_STEP_XLA_OPTIONS; [ $v = ws ] && export OURO_JAX_STEP_XLA_OPTIONS="xla_gpu_experimental_enable_triton_warp_specialization=true"
  timeout 120 python -m benchmarks.profile_step --buckets prefill:1024 prefill:2048 --quick-ceilings --out $OUT/w/prof_$v.json > $OUT/w/prof_$v.log 2>&1; echo "rc $?" >> $OUT/w/prof_$v.log
  echo "== $v"; grep -E "^==|gemm_fusion|nvjet|rc" $OUT/w/prof_$v.log | grep -v -i warn | head -14
done
(cd $OUT/w && tar czf $OUT/all.tgz .)
