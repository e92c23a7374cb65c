#!/bin/bash
# session 17 call 1: XLA GEMM options for small decode (fused steps + generate(); one-loop decode:8 profile), decode attention in an 8-row bucket
export PYTHONPATH=$PWD
mkdir -p $OUT/w
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/w/gpu.txt
pack() { (cd $OUT/w && tar czf $OUT/all.tgz .) ; }
opts() {
  unset OURO_JAX_FUSED_XLA_OPTIONS OURO_JAX_STEP_XLA_OPTIONS
  case $1 in
    notriton) o="xla_gpu_enable_triton_gemm=false";;
    exhaustive) o="xla_gpu_exhaustive_tiling_search=true";;
    *) o="";;
  esac
  if [ -n "$o" ]; then export OURO_JAX_FUSED_XLA_OPTIONS="$o" OURO_JAX_STEP_XLA_OPTIONS="$o"; fi
}
dec() {
  opts $1
  timeout $2 python -m benchmarks.decode --context 1024 --concurrency 1 8 --exit fixed --output-tokens 64 \
    --fused-decode-max-rows 16 --generate-batch 1 --profile-steps 0 --out $OUT/w/dec_$1 --no-plot > $OUT/w/decode_$1.log 2>&1; echo "decode rc $?" >> $OUT/w/decode_$1.log
  echo "== decode $1"; grep -E "TPOT|tok/s|rc" $OUT/w/decode_$1.log | grep -v -i warn | head -8; pack
}
prof() {
  opts $1
  timeout $2 python -m benchmarks.profile_step --buckets decode:8 --quick-ceilings --out $OUT/w/prof_$1.json > $OUT/w/prof_$1.log 2>&1; echo "rc $?" >> $OUT/w/prof_$1.log
  echo "== profile $1"; grep -E "^==|gemm|attention|rc" $OUT/w/prof_$1.log | grep -v -i warn | head -12; pack
}
dec default 140
dec notriton 140
unset OURO_JAX_FUSED_XLA_OPTIONS OURO_JAX_STEP_XLA_OPTIONS
timeout 90 python benchmarks/attention_sweep.py --decode-bucket 8 --decode-rows 1,8 --decode-ctx 1024,4096 --no-prefill --no-copy --out $OUT/w/attn > $OUT/w/attn.log 2>&1; echo "attn rc $?" >> $OUT/w/attn.log
tail -20 $OUT/w/attn.log; pack
prof default 60
prof notriton 60
dec exhaustive 150
