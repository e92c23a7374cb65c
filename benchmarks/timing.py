"""Per-call device time of a jitted chain of calls, with the jit's own launch cancelled.

A jit of ``n`` calls costs ``launch + n * call``; on the H200 host the launch is ~0.2-0.3 ms, as much
as 10-20 small kernels. Timing jits of ``n`` and ``2n`` calls and taking ``(t(2n) - t(n)) / n``
removes it (the sweeps before run 19 divided ``t(n)`` by ``n``).
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
