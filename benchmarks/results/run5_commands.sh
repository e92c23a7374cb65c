#!/usr/bin/env bash
# H200 call 5 (session 3, 2026-11-30): GPU tests of fused decode steps, the hybrid attention split
# and the Mosaic kernel at block_kv 128; per-kernel profile of prefill buckets, Triton vs the
# per-bucket rule (hybrid at R >= 512); serve1k c=1 / c=8 loop by loop vs fused decode; long4 with
# the rule (hybrid) at chunks 128 and 16.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS= OURO_JAX_COMPILE_CACHE=$PWD/.jax_cache
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
R=benchmarks/results; S=$(date +%s); O=${OUT:-/tmp/out5}; mkdir -p "$O"
el() { echo $(( $(date +%s) - S )); }
left() { echo $(( 565 - $(el) )); }
cap() { local c=$1 l; l=$(left); (( c > l )) && c=$l; (( c < 5 )) && c=5; echo "$c"; }
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -s INT -k 10 200 python3 -m pytest -q -p no:cacheprovider \
  --tb=short --durations=12 -m gpu tests/test_gpu_fused_decode.py tests/test_attention_hybrid.py \
  tests/test_attention_mgpu.py "tests/test_gpu_engine.py::test_mosaic_kernel_engine_equals_triton_kernel_engine" \
  > "$O/gpu_tests_run5.txt" 2>&1
echo "[$(el)] gpu tests rc $?: $(tail -n 1 "$O/gpu_tests_run5.txt")"
export XLA_FLAGS=
for att in triton auto; do
  timeout -s INT -k 10 "$(cap 50)" python3 -m benchmarks.profile_step --preset ouro-1.4b --attention $att \
    --buckets prefill:1024 prefill:512 --steps 10 --no-progress --quick-ceilings \
    --out "$O/profile_prefill_$att.json" > "$O/profile_$att.log" 2>&1
  echo "[$(el)] profile $att rc $?"
done
F="--workload serve1k --concurrency 1 8 --exit fixed --max-num-seqs 8 --max-num-batched-tokens 128 --buckets 8 128 --quick-ceilings --no-progress --no-plot --append --out $R/fused_decode"
for fz in "0 1" "8 1" "8 4"; do
  set -- $fz
  timeout -s INT -k 10 "$(cap 65)" python3 -m benchmarks.run $F --fused-decode-max-rows $1 --fused-decode-tokens $2 \
    --time-budget 55 --config-timeout 25 > "$O/fused_$1x$2.log" 2>&1
  echo "[$(el)] serve1k fused $1x$2 rc $?"
done
cp $R/fused_decode/serve1k.json "$O/fused_serve1k.json"
timeout -s INT -k 10 "$(cap 300)" python3 -m benchmarks.run --workload long4 --chunk 128 16 --mode wavefront split mixed \
  --no-progress --no-plot --append --out $R/hybrid --time-budget "$(( $(left) - 12 ))" \
  --config-timeout 40 > "$O/long4_hybrid.log" 2>&1
echo "[$(el)] long4 rule(hybrid) rc $?"
cp $R/hybrid/long4.json "$O/hybrid_long4.json"
grep -hE "tok/s|skip|rror" "$O"/fused_*.log "$O/long4_hybrid.log" | cut -c1-330
grep -hE "^== |attention  " "$O"/profile_*.log
