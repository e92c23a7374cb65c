import os

# CPU tests: keep XLA from grabbing every core's worth of threads on a 2-core machine and make
# float32 matmuls exact-ish so that engine/generate equivalence tests compare like with like.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import tempfile  # noqa: E402

# One persistent compilation cache for the whole session: the many small engines of the tests
# compile the same bucket shapes again and again.
os.environ.setdefault("OURO_JAX_COMPILE_CACHE", tempfile.mkdtemp(prefix="ouro_jax_xla_"))
