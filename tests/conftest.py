"""Test session setup. The jax part runs only where jax is installed, so that the scheduler tests
(``tests/scheduler/``) also run in an environment with only numpy, pytest and hypothesis."""

import importlib.util
import os
import shutil
import subprocess
import tempfile

from hypothesis import settings

# Property tests draw the same examples on every run by default (``derandomize``: a seed from each
# test's own code), so that a run's result, CI's included, is reproducible: a stop's CI once failed
# on an example no earlier run had drawn, a real test bug, which then had to be recovered from the
# printed blob. ``HYPOTHESIS_PROFILE=explore`` draws new examples each run, to look for such cases
# on purpose.
settings.register_profile("reproducible", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "reproducible"))


def _cuda_visible() -> bool:
    """A CUDA plugin for jax is installed and ``nvidia-smi`` lists a GPU: probed without starting a
    jax backend, so the choice below is made before jax initialises any device."""
    try:
        plugin = any(
            importlib.util.find_spec(m) is not None
            for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
        )
    except (ImportError, ValueError):
        plugin = False
    smi = shutil.which("nvidia-smi")
    if not (plugin and smi):
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


if importlib.util.find_spec("jax") is not None:
    # An explicit JAX_PLATFORMS wins; otherwise the CPU is forced only where no CUDA GPU is usable,
    # so that the same command runs the GPU tests on a GPU machine.
    if "JAX_PLATFORMS" not in os.environ and not _cuda_visible():
        os.environ["JAX_PLATFORMS"] = "cpu"
    # CPU tests: keep XLA from grabbing every core's worth of threads on a 2-core machine and make
    # float32 matmuls exact-ish so that engine/generate equivalence tests compare like with like.
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # workers of ``-n N`` share a GPU: none may take 75% of its memory up front
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

    import jax

    jax.config.update("jax_default_matmul_precision", "highest")

    # One persistent compilation cache for the whole session: the many small engines of the tests
    # compile the same bucket shapes again and again.
    os.environ.setdefault("OURO_JAX_COMPILE_CACHE", tempfile.mkdtemp(prefix="ouro_jax_xla_"))
    from ouro_jax.llm import LLM

    # on before anything compiles: an executable JAX compiled before it would never reach the disk
    LLM.enable_compile_cache(os.environ["OURO_JAX_COMPILE_CACHE"])
