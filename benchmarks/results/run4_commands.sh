#!/usr/bin/env bash
# H200 call 4 (session 3, 2026-11-30): Mosaic kernel GPU check (kernel tests, engine forced onto
# it, tuning pass with reference errors), per-kernel profile of three buckets, then mixed128.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS= OURO_JAX_COMPILE_CACHE=$PWD/.jax_cache
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
R=benchmarks/results; S=$(date +%s); O=${OUT:-/tmp/out4}; mkdir -p "$O"
el() { echo $(( $(date +%s) - S )); }
left() { echo $(( 560 - $(el) )); }
cap() { local c=$1 l; l=$(left); (( c > l )) && c=$l; (( c < 5 )) && c=5; echo "$c"; }
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s INT -k 10 170 python3 -m pytest -q -p no:cacheprovider \
  --tb=short --durations=10 -m gpu tests/test_attention_mgpu.py \
  "tests/test_gpu_engine.py::test_mosaic_kernel_engine_equals_triton_kernel_engine" > "$O/gpu_tests_mgpu.txt" 2>&1
echo "[$(el)] mgpu tests rc $?: $(tail -n 1 "$O/gpu_tests_mgpu.txt")"
export XLA_FLAGS=
timeout -s INT -k 5 "$(cap 50)" python3 benchmarks/mgpu_tune.py "$O/mgpu_tune.json" > "$O/mgpu_tune.log" 2>&1
echo "[$(el)] mgpu tune rc $?"
timeout -s INT -k 10 "$(cap 120)" python3 -m benchmarks.profile_step --preset ouro-1.4b \
  --buckets decode:8 decode:128 prefill:1024 --steps 10 --no-progress --out "$O/profile_step.json" > "$O/profile.log" 2>&1
echo "[$(el)] profile rc $?"
timeout -s INT -k 10 "$(cap 400)" python3 -m benchmarks.run --out $R --append --no-plot --time-budget "$(( $(left) - 15 ))" \
  --workload mixed128 --chunk 16 128 --mode wavefront split mixed --config-timeout 150 > "$O/run4_mixed128.log" 2>&1
echo "[$(el)] mixed128 rc $?"
cp $R/mixed128.json "$O/"
grep -E "tok/s|skip|rror" "$O/run4_mixed128.log" | cut -c1-300
