#!/usr/bin/env bash
# H200 calls 7-11 (session 4, 2026-11-30): the configurations issue #5 still lacked, mixed128
# wavefront chunk 128 and mixed32 chunk 128 again on the current engine (hybrid attention), a
# fused-decode serve1k c=1 record, the kernel sweep at the Mosaic kernel's block_kv 128, and a
# same-call A/B of fused decode in the main engine shape. One call per CALL value, in order:
#   CALL=a bash benchmarks/results/run7_to_11_commands.sh     # run 7
#   CALL=b ...  run 8;  CALL=c ...  run 9;  CALL=d ...  run 10;  CALL=e ...  run 11
# Results go to benchmarks/results (merged with --append); records were tagged with their run
# afterwards, and the logs are run{7,8,9,10,11}_pending_*_log.txt.
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
  a)  # run 7 (session 4): the harness's own time estimate skipped mixed at chunk 32 and 64
    run 270 --workload mixed128 --chunk 32 --mode wavefront split mixed --config-timeout 95
    run 130 --workload mixed128 --chunk 64 --mode split mixed --config-timeout 55
    run 120 --workload mixed128 --chunk 128 --mode wavefront --config-timeout 70
    cp $R/mixed128.json "$O/" ;;
  b)  # run 8: what run 7 skipped, the mixed32 and decode_under_prefill gaps, and chunk 128 of
      # both again on the current engine (mixed32 wavefront 128 was still a run-1 scan record)
    run 140 --workload mixed128 --chunk 32 --mode mixed --config-timeout 110
    run 110 --workload mixed128 --chunk 64 --mode mixed --config-timeout 85
    run 110 --workload mixed32 --chunk 32 --mode wavefront split mixed --config-timeout 35
    run 90 --workload decode_under_prefill --chunk 128 --mode split mixed wavefront --config-timeout 30
    run 80 --workload mixed32 --chunk 128 --mode mixed wavefront split --config-timeout 30
    cp $R/mixed128.json $R/mixed32.json $R/decode_under_prefill.json "$O/" ;;
  c)  # run 9: decode_under_prefill at chunk 32 and 64 (never run), a fused-decode c=1 record in
      # the main serve1k.json, the sweep at block_kv 128
    run 130 --workload decode_under_prefill --chunk 32 64 --mode wavefront split mixed --config-timeout 30
    run 70 --workload serve1k --concurrency 1 --exit fixed --fused-decode-max-rows 8 --config-timeout 40
    timeout -s INT -k 10 "$(left)" python3 benchmarks/attention_sweep.py --out $R --no-copy > "$O/attention_sweep.log" 2>&1
    echo "[$(el)] sweep rc $?"
    cp $R/decode_under_prefill.json $R/serve1k.json $R/attention_sweep.json "$O/" ;;
  e)  # run 11: long4 (every chunk x mode, and the generate() baseline) and decode_under_prefill
      # chunk 16 on the current engine, replacing run-2 records that predate hybrid attention and
      # the Triton kernel's empty-item fix (which sped up every S = R bucket, wavefront's most)
    run 200 --workload long4 --chunk 16 32 64 128 --mode split mixed wavefront --generate-baseline long4 \
      --config-timeout 40
    run 90 --workload decode_under_prefill --chunk 16 --mode split mixed wavefront --config-timeout 30
    cp $R/long4.json $R/decode_under_prefill.json "$O/" ;;
  d)  # run 10: run 9's fused c=1 record (77.96 out tok/s) sat below run 3's loop-by-loop one (80.35)
      # in the main engine shape (128 seqs, 1024 tokens); one call, same machine, all three
    for f in "0 1" "8 1" "8 4"; do set -- $f
      run 80 --workload serve1k --concurrency 1 --exit fixed --fused-decode-max-rows $1 \
        --fused-decode-tokens $2 --out $R/fused_decode_main --config-timeout 40
    done
    cp $R/fused_decode_main/serve1k.json "$O/serve1k_main_shape.json" ;;
esac
grep -hE "tok/s|skip|rror" "$O/pending_$CALL.log" | cut -c1-300
