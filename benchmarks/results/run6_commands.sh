#!/usr/bin/env bash
# H200 call 6 (session 3, 2026-11-30): GPU tests left from run 5 plus those the Triton kernel's
# empty-item change touches (kernel vs reference, engine equivalence, forced kernels); the
# prefill profile with the rule (hybrid) again; long4 wavefront chunk 128 with the rule (run 5's
# was cut by a harness bug); then mixed128 configurations not yet measured.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS= OURO_JAX_COMPILE_CACHE=$PWD/.jax_cache
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
R=benchmarks/results; S=$(date +%s); O=${OUT:-/tmp/out6}; mkdir -p "$O"
el() { echo $(( $(date +%s) - S )); }
left() { echo $(( 555 - $(el) )); }
cap() { local c=$1 l; l=$(left); (( c > l )) && c=$l; (( c < 5 )) && c=5; echo "$c"; }
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s INT -k 10 190 python3 -m pytest -q -p no:cacheprovider \
  --tb=short --durations=12 -m gpu \
  "tests/test_gpu_engine.py::test_mosaic_kernel_engine_equals_triton_kernel_engine" \
  "tests/test_gpu_engine.py::test_pallas_engine_equals_reference_engine_and_generate[wavefront-unrolled-0.6]" \
  "tests/test_gpu_engine.py::test_pallas_engine_equals_reference_engine_and_generate[split-scan-1.0]" \
  tests/test_pallas_attention.py "tests/test_attention_mgpu.py::test_mgpu_ouro_shapes" \
  > "$O/gpu_tests_run6.txt" 2>&1
echo "[$(el)] gpu tests rc $?: $(tail -n 1 "$O/gpu_tests_run6.txt")"
export XLA_FLAGS=
timeout -s INT -k 10 "$(cap 50)" python3 -m benchmarks.profile_step --preset ouro-1.4b --attention auto \
  --buckets prefill:1024 --steps 10 --no-progress --quick-ceilings \
  --out "$O/profile_prefill_auto_run6.json" > "$O/profile_auto_run6.log" 2>&1
echo "[$(el)] profile rc $?"
timeout -s INT -k 10 "$(cap 120)" python3 -m benchmarks.run --workload long4 --chunk 128 --mode wavefront \
  --no-progress --no-plot --append --out $R/hybrid --time-budget 110 --config-timeout 40 > "$O/long4_hybrid_run6.log" 2>&1
echo "[$(el)] long4 wavefront 128 rc $?"
cp $R/hybrid/long4.json "$O/hybrid_long4.json"
timeout -s INT -k 10 "$(cap 160)" python3 -m benchmarks.run --workload mixed128 --chunk 128 --mode split mixed \
  --no-progress --no-plot --append --out $R --time-budget 150 --config-timeout 70 > "$O/mixed128_run6.log" 2>&1
echo "[$(el)] mixed128 chunk 128 rc $?"
timeout -s INT -k 10 "$(cap 400)" python3 -m benchmarks.run --workload mixed128 --chunk 64 --mode wavefront split mixed \
  --no-progress --no-plot --append --out $R --time-budget "$(( $(left) - 12 ))" --config-timeout 90 \
  >> "$O/mixed128_run6.log" 2>&1
echo "[$(el)] mixed128 chunk 64 rc $?"
cp $R/mixed128.json "$O/"
grep -hE "tok/s|skip|rror" "$O/long4_hybrid_run6.log" "$O/mixed128_run6.log" | cut -c1-330
grep -hE "^== |attention  |mosaic" "$O/profile_auto_run6.log"
