#!/bin/bash
# H200 session 11 call 1: where the engine's fused decode step loses ~0.7 ms a loop against generate()
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee $OUT/gpu.txt
for cfg in "KV_GB=4" "KV_GB=0" "KV_GB=4 TOKENS=4" "KV_GB=4 XLA_FLAGS=--xla_gpu_enable_command_buffer="; do
  echo "=== $cfg"
  env $cfg timeout 150 python .scratch/fused_probe.py 2>&1 | grep -vi "warn\|^ *$" | tail -4 | tee -a $OUT/fused_probe.log
done
