#!/bin/bash
# Session 14 call 6: start-up with rope_write_kv (cold / cached), and a second prefill:1024 + decode:8 profile
export PYTHONPATH=$PWD
L=$OUT/call6.log
timeout 200 python -m benchmarks.startup --starts 2 --out $OUT/startup.json >> $L 2>&1; echo "startup rc=$?" >> $L
timeout 90 python -m benchmarks.profile_step --preset ouro-1.4b --buckets prefill:1024 prefill:2048 decode:8 --steps 10 --quick-ceilings --no-progress --out $OUT/profile_step.json >> $L 2>&1; echo "profile rc=$?" >> $L
grep -E "rc=|==|cold|cached|start" $L | head -30
