"""benchmarks.decode with the fused steps compiled on XLA's default command buffers (no WHILE/CONDITIONAL)."""

import sys

import ouro_jax.runner as runner

runner.FUSED_COMMAND_BUFFER = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"
from benchmarks.decode import main  # noqa: E402

main(sys.argv[1:])
