#!/usr/bin/env bash
# Prepared for the next H200 session (NOT yet run): the configurations issue #5 still lacks, the
# wavefront chunk-128 mixed128 record with hybrid attention, a fused-decode serve1k c=1 record in
# the main serve1k.json, and the kernel sweep at the Mosaic kernel's tuned block_kv 128.
#   CALL=a bash benchmarks/pending_calls.sh     # ~9 min: mixed128
#   CALL=b bash benchmarks/pending_calls.sh     # ~8 min: mixed32, decode_under_prefill, serve1k, sweep
# Results go to benchmarks/results (merged with --append; every record is tagged with its run when
# merged into the committed files, see benchmarks/merge_results.py).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS= OURO_JAX_COMPILE_CACHE=$PWD/.jax_cache
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 XLA_FLAGS=
R=benchmarks/results; S=$(date +%s); O=${OUT:-/tmp/out_pending}; mkdir -p "$O"
el() { echo $(( $(date +%s) - S )); }
left() { echo $(( 560 - $(el) )); }
run() {  # run SECONDS ARGS...: benchmarks.run under a cap, appending to $R
  local c=$1; shift
  (( c > $(left) )) && c=$(left)
  (( c < 30 )) && { echo "skip: $*"; return; }
  timeout -s INT -k 10 "$c" python3 -m benchmarks.run --out $R --append --no-plot --no-progress \
    --time-budget "$(( c - 10 ))" "$@" >> "$O/pending_$CALL.log" 2>&1
  echo "[$(el)] rc $?: $*"
}
case "${CALL:-a}" in
  a)
    run 200 --workload mixed128 --chunk 32 --mode wavefront split mixed --config-timeout 100
    run 130 --workload mixed128 --chunk 64 --mode split mixed --config-timeout 60
    run 200 --workload mixed128 --chunk 128 --mode wavefront --config-timeout 100
    cp $R/mixed128.json "$O/" ;;
  b)
    run 120 --workload mixed32 --chunk 32 --mode wavefront split mixed --config-timeout 30
    run 60 --workload mixed32 --chunk 128 --mode mixed --config-timeout 30
    run 80 --workload decode_under_prefill --chunk 128 --mode split mixed --config-timeout 30
    run 70 --workload serve1k --concurrency 1 --exit fixed --fused-decode-max-rows 8 --config-timeout 40
    timeout -s INT -k 10 "$(left)" python3 benchmarks/attention_sweep.py --out $R --no-copy > "$O/attention_sweep.log" 2>&1
    echo "[$(el)] sweep rc $?"
    cp $R/mixed32.json $R/decode_under_prefill.json $R/serve1k.json $R/attention_sweep.json "$O/" ;;
esac
grep -hE "tok/s|skip|rror" "$O/pending_$CALL.log" | cut -c1-300
