#!/bin/bash
# session 13 call 4: matvec tuning round 2; command-buffer update mode on c=1 decode; fused engine if a tuning wins
export PYTHONPATH=$PWD
timeout 120 python .scratch/matvec_probe.py > $OUT/matvec_probe2.log 2>&1; echo "rc $?" >> $OUT/matvec_probe2.log
grep -v "Warn\|warn" $OUT/matvec_probe2.log | tail -22
B="python -m benchmarks.decode --context 1024 --concurrency 1 --exit fixed ouro0.5 --output-tokens 128 --fused-decode-max-rows 16 --profile-steps 0"
timeout 140 $B --out $OUT/cb_default > $OUT/cb_default.log 2>&1; echo "rc $?" >> $OUT/cb_default.log
grep "TPOT\|ERROR\|rc " $OUT/cb_default.log | tail -4
OURO_JAX_FUSED_XLA_OPTIONS="xla_gpu_command_buffer_update_mode=SKIP_TEMP" timeout 140 $B --out $OUT/cb_skip_temp > $OUT/cb_skip_temp.log 2>&1; echo "rc $?" >> $OUT/cb_skip_temp.log
grep "TPOT\|ERROR\|rc \|Error" $OUT/cb_skip_temp.log | tail -4
BEST=$(cat $OUT/best_tuning 2>/dev/null)
if [ -n "$BEST" ]; then
  OURO_JAX_MATVEC_TUNING=$BEST timeout 140 $B --decode-matmul fused --out $OUT/fused > $OUT/decode_fused.log 2>&1; echo "rc $?" >> $OUT/decode_fused.log
  grep "TPOT\|ERROR\|rc " $OUT/decode_fused.log | tail -4
fi
