"""Ceilings measured in the same run as the figure they bound: bf16 matmul TFLOP/s, copy bandwidth."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

# What the H200 gave when these were first measured (docs/performance.md); used on CPU runs only.
H200_DEFAULTS = dict(peak_flops=785e12, bandwidth=4.0e12)


def _time(f, *args, reps=10):
    f(*args).block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        out = f(*args)
    out.block_until_ready()
    return (time.perf_counter() - t) / reps


def measure(quick: bool = False) -> dict:
    """On the GPU: 8192^3 bf16 matmul and a 2 GiB read+write copy. Elsewhere: the H200 defaults.

    ``quick``: fewer repetitions of the same matmul. It used to be a 4096^3 matmul, which read
    640-680 TFLOP/s on the H200 against 777-787 for 8192^3 (run 25; likely because a 0.18 ms
    kernel is timed with its launches), so FLOP floors priced with it came out ~15% longer and
    fractions of floor ~15% higher than against the full peak (docs/decisions.md, "cuBLAS GEMMs
    for prompt-sized steps")."""
    if jax.default_backend() != "gpu":
        return dict(H200_DEFAULTS, measured=False, device=str(jax.devices()[0]))
    n = 8192
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda x, y: x @ y)
    peak = 2 * n**3 / _time(mm, a, b, reps=4 if quick else 10)
    del a, b
    return dict(peak_flops=peak, bandwidth=copy_bandwidth(), measured=True, device=jax.devices()[0].device_kind)


def copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB read + write (``x * 2``)."""
    x = jnp.ones((512 * 1024 * 1024,), jnp.float32)
    return 2 * x.nbytes / _time(jax.jit(lambda v: v * 2), x)
