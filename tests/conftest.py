import os

# CPU tests: keep XLA from grabbing every core's worth of threads on a 2-core machine and make
# float32 matmuls exact-ish so that engine/generate equivalence tests compare like with like.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
