"""Per-call device time of a jitted chain of calls, with the jit's own launch cancelled.

A jit of ``n`` calls costs ``launch + n * call``; on the H200 host the launch is ~0.2-0.3 ms, as much
as 10-20 small kernels. Timing jits of ``n`` and ``2n`` calls and taking ``(t(2n) - t(n)) / n``
removes it (the sweeps before run 19 divided ``t(n)`` by ``n``).

``kernel_us`` / ``kernels_us`` read kernel device time alone (CUPTI, through Mosaic GPU's profiler):
no launch, no host; what a call costs inside the engine's CUDA graphs, less the gaps between kernels.
"""

from __future__ import annotations

import statistics
import time

import jax


def median_s(fn, args, reps: int) -> float:
    """Median wall time of ``fn(*args)`` to completion: one compile call, 2 warm-ups, ``reps`` runs."""
    jax.block_until_ready(fn(*args))  # compile
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def per_call_s(make, args, n: int, reps: int) -> float:
    """Seconds per call: ``(t(2n) - t(n)) / n`` for the jits ``make(n)`` and ``make(2n)`` (both
    called with ``args``); ``t(2n) / 2n``, an upper bound, where noise makes the difference
    non-positive."""
    t1 = median_s(make(n), args, reps)
    t2 = median_s(make(2 * n), args, reps)
    return (t2 - t1) / n if t2 > t1 else t2 / (2 * n)


def kernels_us(fn, *args, iters: int) -> dict[str, float]:
    """Median device time (us) of each kernel one call of ``fn`` launches, by kernel name (a name
    launched twice a call sums), in launch order. GPU only (CUPTI)."""
    from jax.experimental.mosaic.gpu import profiler

    _, per_iter = profiler.measure(fn, aggregate=False, iterations=iters)(*args)
    if iters == 1:
        per_iter = [per_iter]
    sums: list[dict[str, float]] = []
    for launches in per_iter:
        one: dict[str, float] = {}
        for name, ms in launches:
            one[name] = one.get(name, 0.0) + ms * 1e3
        sums.append(one)
    return {name: statistics.median(s[name] for s in sums) for name in sums[0]}


def kernel_us(fn, *args, iters: int) -> float:
    """Median kernel device time (us) of one call of ``fn``: all its kernels. GPU only (CUPTI)."""
    from jax.experimental.mosaic.gpu import profiler

    _, times = profiler.measure(fn, iterations=iters)(*args)
    return statistics.median([times] if iters == 1 else times) * 1e3
