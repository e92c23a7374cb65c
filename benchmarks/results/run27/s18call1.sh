#!/bin/bash
# session 18 call 1: the folded Triton combine on the H200: GPU correctness (repeated launches,
# counters), decode:8 profile A/B (off / decode), then the decode benchmark with the fold.
export PYTHONPATH=$PWD
mkdir -p $OUT/w
pack() { (cd $OUT/w && tar czf $OUT/all.tgz .) ; }
git log --oneline -1 > $OUT/w/commit.txt
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/w/gpu.txt
t0=$(date +%s)
timeout 75 python -m pytest -q -m gpu tests/test_pallas_attention.py -k "fold_combine_repeated" > $OUT/w/gpu_fold.log 2>&1; echo "rc $?" >> $OUT/w/gpu_fold.log
echo "== gpu tests ($(( $(date +%s) - t0 )) s)"; tail -4 $OUT/w/gpu_fold.log; pack
for f in off decode; do
  t1=$(date +%s)
  OURO_JAX_FOLD_COMBINE=$f timeout 50 python -m benchmarks.profile_step --buckets decode:8 --steps 10 --reps 30 --quick-ceilings --no-progress --out $OUT/w/prof_$f.json > $OUT/w/prof_$f.log 2>&1; echo "rc $?" >> $OUT/w/prof_$f.log
  echo "== profile $f ($(( $(date +%s) - t1 )) s)"; grep -E "wall|attention|combine|kernels|rc " $OUT/w/prof_$f.log | grep -v -i warn | head -12; pack
done
t1=$(date +%s)
OURO_JAX_FOLD_COMBINE=decode timeout 90 python -m benchmarks.decode --context 1024 --concurrency 1 8 --exit fixed --output-tokens 64 \
  --fused-decode-max-rows 16 --generate-batch --profile-steps 0 --quick-ceilings --no-progress --out $OUT/w/dec_fold --no-plot > $OUT/w/decode_fold.log 2>&1; echo "rc $?" >> $OUT/w/decode_fold.log
echo "== decode fold ($(( $(date +%s) - t1 )) s)"; grep -E "TPOT|tok/s|rc " $OUT/w/decode_fold.log | grep -v -i warn | head -8; pack
