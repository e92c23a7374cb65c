#!/bin/bash
# Session 14 call 8: decode_under_prefill wavefront chunk 16, rope_write_kv off / on in one call
export PYTHONPATH=$PWD
L=$OUT/call8.log
for m in xla kernel; do
  OURO_JAX_ROPE_WRITE=$m timeout 100 python -m benchmarks.run --workload decode_under_prefill --mode wavefront --chunk 16 --no-plot --out $OUT/dup_$m >> $L 2>&1; echo "dup $m rc=$?" >> $L
done
grep -E "rc=|decode TPOT" $L | grep -v "%|" | head -10
