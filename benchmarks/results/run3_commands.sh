#!/usr/bin/env bash
# H200 call 3 of 2026-11-29 (one 10-minute device call; what it ran, in order, each under a cap).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS= OURO_JAX_COMPILE_CACHE=$PWD/.jax_cache
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
R=benchmarks/results; S=$(date +%s); O=${OUT:-/tmp/out3}; mkdir -p "$O"
el() { echo $(( $(date +%s) - S )); }
left() { echo $(( 570 - $(el) )); }
cap() { local c=$1 l; l=$(left); (( c > l )) && c=$l; (( c < 5 )) && c=5; echo "$c"; }
# 1 correctness on the GPU (XLA GEMM autotuning off: compile time dominates these tests)
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s INT -k 10 190 python3 -m pytest -q -p no:cacheprovider \
  --tb=short --durations=20 -m gpu tests/test_gpu_engine.py tests/test_attention_mgpu.py > "$O/gpu_tests.txt" 2>&1
echo "[$(el)] gpu tests rc $?: $(tail -n 1 "$O/gpu_tests.txt")"
export XLA_FLAGS=
# 2 serve1k c=1 fixed depth (cold compile of the engine's buckets included; fills the cache)
timeout -s INT -k 10 "$(cap 105)" python3 -m benchmarks.run --out $R --append --no-plot --time-budget 95 \
  --workload serve1k --concurrency 1 --exit fixed --config-timeout 90 > "$O/run3_serve1k.log" 2>&1
echo "[$(el)] serve1k c=1 rc $?"
# 3 generate() at c=128
timeout -s INT -k 10 "$(cap 70)" python3 -m benchmarks.run --out $R --append --no-plot --time-budget 60 \
  --workload serve1k --generate-only --concurrency 128 --generate-concurrency 128 --generate-estimate 35 \
  > "$O/run3_generate.log" 2>&1
echo "[$(el)] generate c=128 rc $?"
# 4 mixed32 at chunks 16/64/32 (128 was run 2), then decode_under_prefill chunk 128 split/mixed
timeout -s INT -k 10 "$(cap 140)" python3 -m benchmarks.run --out $R --append --no-plot --time-budget 130 \
  --workload mixed32 --chunk 16 64 32 --mode wavefront split mixed --config-timeout 30 > "$O/run3_mixed32.log" 2>&1
echo "[$(el)] mixed32 rc $?"
timeout -s INT -k 10 "$(cap 45)" python3 -m benchmarks.run --out $R --append --no-plot --time-budget 40 \
  --workload decode_under_prefill --chunk 128 --mode split mixed --config-timeout 20 > "$O/run3_dup.log" 2>&1
echo "[$(el)] decode_under_prefill rc $?"
# 5 Mosaic GPU kernel tuning pass (block_kv x stages)
timeout -s INT -k 5 "$(cap 45)" python3 benchmarks/mgpu_tune.py "$O/mgpu_tune.json" > "$O/mgpu_tune.log" 2>&1
echo "[$(el)] mgpu tune rc $?"
tar -czf "$O/results.tar.gz" $R/serve1k.json $R/mixed32.json $R/decode_under_prefill.json 2>/dev/null
cat "$O"/run3_*.log | grep -E "tok/s|skip|rror" | cut -c1-400
