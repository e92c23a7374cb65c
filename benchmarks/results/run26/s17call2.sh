#!/bin/bash
# session 17 call 2: skinny Mosaic GEMM in decode buckets (default splits / no split-K for qkv + gate_up), then the fused coda A/B
export PYTHONPATH=$PWD
mkdir -p $OUT/w
pack() { (cd $OUT/w && tar czf $OUT/all.tgz .) ; }
S1="2048x6144:block_n=64,splits=1;2048x11264:block_n=64,splits=1"
for v in mgpu split1; do
  unset OURO_JAX_SKINNY_TUNING; [ $v = split1 ] && export OURO_JAX_SKINNY_TUNING="$S1"
  timeout 70 python -m benchmarks.profile_step --buckets decode:8 --decode-matmul mgpu --quick-ceilings --out $OUT/w/prof_$v.json > $OUT/w/prof_$v.log 2>&1; echo "rc $?" >> $OUT/w/prof_$v.log
  echo "== profile $v"; grep -E "^==|gemm|nvjet|mosaic|attention|fusion|rc" $OUT/w/prof_$v.log | grep -v -i warn | head -16; pack
done
for v in mgpu split1; do
  unset OURO_JAX_SKINNY_TUNING; [ $v = split1 ] && export OURO_JAX_SKINNY_TUNING="$S1"
  timeout 110 python -m benchmarks.decode --context 1024 --concurrency 1 8 --exit fixed --output-tokens 64 \
    --fused-decode-max-rows 16 --decode-matmul mgpu --generate-batch --profile-steps 0 --out $OUT/w/dec_$v --no-plot > $OUT/w/decode_$v.log 2>&1; echo "decode rc $?" >> $OUT/w/decode_$v.log
  echo "== decode $v"; grep -E "TPOT|rc" $OUT/w/decode_$v.log | grep -v -i warn | head -6; pack
done
unset OURO_JAX_SKINNY_TUNING
export OURO_JAX_FUSED_CODA=always
timeout 200 python -m benchmarks.decode --context 1024 --concurrency 8 --exit ouro0.5 synthetic2.5 --output-tokens 128 \
  --fused-decode-max-rows 16 --fused-decode-tokens 8 --fused-decode-rows lockstep independent --generate-batch --profile-steps 0 --out $OUT/w/dec_coda --no-plot > $OUT/w/decode_coda.log 2>&1; echo "decode rc $?" >> $OUT/w/decode_coda.log
echo "== coda always"; grep -E "TPOT|rc" $OUT/w/decode_coda.log | grep -v -i warn | head -8; pack
