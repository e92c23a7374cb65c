#!/bin/bash
# Session 14 call 7: decode_under_prefill with target_tpot_ms at 3x / 4x the decode floor (issue 14)
export PYTHONPATH=$PWD
L=$OUT/call7.log
timeout 240 python -m benchmarks.run --workload decode_under_prefill --mode wavefront --chunk 16 --target-tpot-floor-multiple 3 4 --no-plot --out $OUT/dup >> $L 2>&1; echo "dup rc=$?" >> $L
grep -E "rc=|decode TPOT|target" $L | grep -v "%|" | head -20
