#!/usr/bin/env bash
# The benchmark campaign for one H200 call (10-minute hard limit): the standard workloads in
# priority order, each under a time budget, then the bucket sweep and the report. Results come
# back through $OUT (at most 8 files): results.tar.gz (all of benchmarks/results), REPORT.md,
# campaign_log.txt and the headline JSONs; $OUT is refreshed after every stage, so a call cut
# short still returns what was done.
#
#   bash benchmarks/campaign.sh                                   # repository root, GPU machine
#   CAMPAIGN_SECONDS=300 STAGES="serve1k+long4 sweep" bash benchmarks/campaign.sh
#   EXTRA_ARGS="--preset tiny --scale 0.02 --count-scale 0.05 --max-num-seqs 8 --max-num-batched-tokens 64" \
#     CAMPAIGN_SECONDS=120 OUT=/tmp/out bash benchmarks/campaign.sh       # a dry run on a CPU
#
# The machine's own python3 and packages (PYTHONPATH=$PWD, nothing installed). About 8 minutes
# (CAMPAIGN_SECONDS, default 480): a stage gets min(its budget, time left - 25 s kept for the
# report) and is skipped under 30 s, so when time runs short the lowest priorities go first.
# Inside a stage `--time-budget` starts no configuration past the budget and truncates the one
# running at it (records are saved after every configuration; a truncated one says so);
# `timeout` is the backstop, never past CAMPAIGN_SECONDS + 30. Budgets are process wall seconds,
# start-up included (~15 s: CUDA, random 1.4B weights, ceilings). The first stage also pays the
# cold compile of the 8 bucket executables; later processes load them from the persistent
# compilation cache in .jax_cache/ (git-ignored: it stays on a warm machine between calls).
#
#   stage                       what                                                      budget s
#   (background, CPU)           padding analysis of every workload's sweep (scheduler alone) <= 200
#   0 gpu-tests                 pytest -m gpu: Pallas engine = reference engine = generate(),
#                               kernels vs their jnp twins, KV writes in place (gpu_tests.txt)  150
#   mgpu-check (not default)    Mosaic GPU kernel: its GPU tests (kernel, engine forced onto it,
#                               autotune off) and benchmarks/mgpu_tune.py                      200
#   attention (not default)     benchmarks/attention_sweep.py: both Pallas kernels vs cuDNN    230
#   profile (not default; runs after generate) benchmarks/profile_step.py: device time per
#                               kernel, per bucket                                           120
#   1 serve1k+long4             one process (one start-up, one cold compile):                  225
#       serve1k                 c = 1, 128, 32 x fixed depth / synthetic early exit
#                               (split, chunk 64)                                     130 of it
#       long4                   chunks 16, 128, 64, 32 x wavefront, split, mixed       95 of it
#   2 mixed32+decode_under_prefill    one process                                             85
#       mixed32                 chunks 128, 16, 64, 32 x wavefront, split, mixed       45 of it
#                               (the whole sweep needs ~3 min at 30% of its floor: expect 2-4
#                               configurations here, the rest listed as skipped)
#       decode_under_prefill    chunks 16, 128 x wavefront, split, mixed               40 of it
#   3 generate()                static-batch baselines: long4, then serve1k c = 1, 32, 128
#                               (exactly c requests; c=128's 116 GB dense cache may not fit: last) 80
#   4 bucket sweep              device part: per bucket compile, memory, device time, roofline  30
#   5 mixed128                  chunks 128, 16, 64, 32 x wavefront, split, mixed: what remains rest
#                               (the whole sweep needs ~12 min at 30% of its floor: a second call
#                               with STAGES=mixed128 CAMPAIGN_SECONDS=540 runs more of it)
#   6 report                    REPORT.md and the plots                                     <= 40
# Within a workload the sweep runs in priority order (benchmarks/workloads.py: the targets first).
# Engine settings shared by every stage (so executables repeat): max_num_seqs 128,
# max_num_batched_tokens 1024, max_model_len 8192, block 16, buckets 8..1024, ring for chunk 128;
# XLA gets 95% of the GPU and the KV pool 90% of that (c=128 x 1152 tokens x 4 planes = 116 GB).
set -u
cd "$(dirname "$0")/.."
START=$(date +%s)
TOTAL=${CAMPAIGN_SECONDS:-480}
STAGES=${STAGES:-"gpu-tests serve1k+long4 mixed32+decode_under_prefill generate sweep mixed128"}
RES=${RESULTS:-benchmarks/results}
OUTDIR=${OUT:-/tmp/ouro_campaign_out}
mkdir -p "$RES" "$OUTDIR"
export OURO_JAX_COMPILE_CACHE=${OURO_JAX_COMPILE_CACHE:-$PWD/.jax_cache}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
LOG=$RES/campaign_log.txt
RESERVE=25
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"  # appended to every run / sweep (the dry run's tiny shapes)
: > "$LOG"

now() { echo $(( $(date +%s) - START )); }
left() { echo $(( TOTAL - $(now) )); }
say() { echo "[$(now)s] $*" | tee -a "$LOG"; }
wants() { [[ " $STAGES " == *" $1 "* ]]; }

snapshot() {  # refresh $OUT (at most 8 files)
  tar -czf "$OUTDIR/results.tar.gz.tmp" -C "$(dirname "$RES")" "$(basename "$RES")" 2>/dev/null \
    && mv "$OUTDIR/results.tar.gz.tmp" "$OUTDIR/results.tar.gz"
  for f in REPORT.md serve1k.json long4.json bucket_sweep.json; do
    [ -f "$RES/$f" ] && cp "$RES/$f" "$OUTDIR/"
  done
  cp "$LOG" "$OUTDIR/campaign_log.txt"
}

budget_for() {  # budget_for WANTED: min(WANTED, time left - reserve); 0 when under 30 s
  local b=$1 avail=$(( $(left) - RESERVE ))
  (( b > avail )) && b=$avail
  (( b < 30 )) && b=0
  echo "$b"
}

hard_limit() {  # budget + 40 s for teardown, never past TOTAL + 30
  local h=$(( $1 + 40 )) cap=$(( TOTAL + 30 - $(now) ))
  (( h > cap )) && h=$cap
  (( h < 10 )) && h=10
  echo "$h"
}

run_stage() {  # run_stage STAGE BUDGET ARGS...  (python3 -m benchmarks.run ARGS)
  local name=$1 want=$2; shift 2
  wants "$name" || return 0
  local b; b=$(budget_for "$want")
  if (( b == 0 )); then say "skip $name: $(left) s left"; return 0; fi
  say "start $name (budget $b s)"
  timeout -s INT -k 15 "$(hard_limit "$b")" python3 -m benchmarks.run --out "$RES" --time-budget "$b" \
    --no-plot "$@" ${EXTRA[@]+"${EXTRA[@]}"} >> "$LOG" 2>&1
  say "end $name (rc $?)"
  snapshot
}

say "campaign: $TOTAL s; stages: $STAGES; compile cache $OURO_JAX_COMPILE_CACHE"
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem --format=csv >> "$LOG" 2>&1

PAD_PID=
if wants sweep; then  # no GPU needed: beside the GPU stages, one core, low priority
  ( JAX_PLATFORMS=cpu nice -n 10 timeout -s INT -k 10 230 python3 -m benchmarks.sweep_buckets --part padding \
      --json "$RES/bucket_padding.json" --time-budget 200 --no-plot --no-progress ${EXTRA[@]+"${EXTRA[@]}"} \
      > "$RES/bucket_padding_log.txt" 2>&1 ) &
  PAD_PID=$!
fi

if wants gpu-tests; then  # correctness on the GPU first: Pallas engine vs reference engine vs generate()
  b=$(budget_for "${GPU_TESTS_SECONDS:-150}")
  if (( b > 0 )); then
    say "start gpu-tests (budget $b s)"
    ( export JAX_PLATFORMS= XLA_FLAGS=; timeout -s INT -k 10 "$b" python3 -m pytest -q -p no:cacheprovider -p no:warnings \
        --tb=short --durations=15 -m gpu ${GPU_TESTS_PATHS:-tests/} > "$RES/gpu_tests.txt" 2>&1 )
    say "end gpu-tests (rc $?): $(tail -n 1 "$RES/gpu_tests.txt")"
    snapshot
  fi
fi

if wants mgpu-check; then  # the Mosaic GPU kernel: correctness (kernel, engine forced onto it), tuning
  b=$(budget_for 200)
  if (( b > 0 )); then
    say "start mgpu-check (budget $b s)"
    ( export JAX_PLATFORMS= XLA_FLAGS=--xla_gpu_autotune_level=0; timeout -s INT -k 10 "$(( b - 50 ))" \
        python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu tests/test_attention_mgpu.py \
        "tests/test_gpu_engine.py::test_mosaic_kernel_engine_equals_triton_kernel_engine" \
        > "$RES/gpu_tests_mgpu.txt" 2>&1 )
    say "end mgpu tests (rc $?): $(tail -n 1 "$RES/gpu_tests_mgpu.txt")"
    ( export JAX_PLATFORMS= XLA_FLAGS=; timeout -s INT -k 5 45 python3 benchmarks/mgpu_tune.py \
        "$RES/mgpu_tune.json" > "$RES/mgpu_tune.log" 2>&1 )
    say "end mgpu tune (rc $?)"
    snapshot
  fi
fi

if wants attention; then  # kernel sweep: Triton vs Mosaic GPU vs cuDNN vs reference (attention_sweep.json)
  b=$(budget_for 230)
  if (( b > 0 )); then
    say "start attention sweep (budget $b s)"
    ( export JAX_PLATFORMS= XLA_FLAGS=; timeout -s INT -k 10 "$b" python3 benchmarks/attention_sweep.py \
        --out "$RES" --no-copy > "$RES/attention_sweep.log" 2>&1 )
    say "end attention sweep (rc $?): $(tail -n 1 "$RES/attention_sweep.log")"
    snapshot
  fi
fi

run_stage serve1k+long4 225 --workload serve1k long4 --workload-budget serve1k=130 long4=95 \
  --concurrency 1 128 32 --exit fixed early --generate-baseline --config-timeout 40
run_stage mixed32+decode_under_prefill 85 --workload mixed32 decode_under_prefill \
  --workload-budget mixed32=45 decode_under_prefill=40 --config-timeout 20
run_stage generate 80 --workload long4 serve1k --generate-only --append --concurrency 1 128 32 \
  --generate-concurrency 1 32 128 --generate-estimate 35

if wants sweep; then
  b=$(budget_for 30)
  if (( b > 0 )); then
    say "start bucket sweep (budget $b s)"
    timeout -s INT -k 10 "$(hard_limit "$b")" python3 -m benchmarks.sweep_buckets --part device --out "$RES" \
      --merge "$RES/bucket_padding.json" --reps 10 --no-plot ${EXTRA[@]+"${EXTRA[@]}"} >> "$LOG" 2>&1
    say "end bucket sweep (rc $?)"
    snapshot
  else
    say "skip bucket sweep: $(left) s left"
  fi
fi

if wants profile; then  # where one invocation's device time goes, per kernel (profile_step.json)
  b=$(budget_for 120)
  if (( b > 0 )); then
    say "start profile (budget $b s)"
    timeout -s INT -k 10 "$(hard_limit "$b")" python3 -m benchmarks.profile_step ${PROFILE_ARGS:-} \
      --out "$RES/profile_step.json" >> "$LOG" 2>&1
    say "end profile (rc $?)"
    snapshot
  fi
fi

run_stage mixed128 600 --workload mixed128 --config-timeout 25

if [ -n "$PAD_PID" ]; then
  wait "$PAD_PID" 2>/dev/null
  say "padding analysis: $(tail -n 1 "$RES/bucket_padding_log.txt" 2>/dev/null)"
  if [ -f "$RES/bucket_sweep.json" ] && [ -f "$RES/bucket_padding.json" ]; then  # fold it in if it came late
    python3 -m benchmarks.sweep_buckets --part --out "$RES" --merge "$RES/bucket_padding.json" --no-plot \
      >> "$LOG" 2>&1
  fi
fi

say "report"
timeout -s INT -k 5 40 python3 -m benchmarks.report --results "$RES" >> "$LOG" 2>&1
say "report (rc $?); done"
snapshot
