#!/bin/bash
# H200 session 11 call 2: does a static depth trip count, or XLA's WHILE command buffers, remove the fused step's per-call loss?
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"
for cfg in "STATIC=" "STATIC=1" "STATIC= XLA_FLAGS=$CB" "STATIC=1 XLA_FLAGS=$CB" "STATIC=1 TOKENS=4"; do
  echo "=== $cfg"
  env $cfg timeout 110 python .scratch/fused_probe.py 2>&1 | grep -vi "warn\|^ *$" | tail -4 | tee -a $OUT/fused_probe2.log
done
