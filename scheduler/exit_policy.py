"""The per-token exit rule (engine-semantics.md, "Exit policy"), as pure functions on floats.

A decode token runs one loop per invocation. After loop ``t`` (``loops_done = t + 1``) the host
decides whether the token exits there. The rule depends on the request's ``exit_mode``:

- ``ouro``: ``remaining *= 1 - sigmoid(g[t])`` for every loop (loops before ``min_loops`` count
  too); exit when ``loops_done >= max_loops`` or ``exit_threshold < 1 and loops_done >= min_loops
  and 1 - remaining >= exit_threshold``.
- ``delayed``: exit one loop later than ``ouro`` would (capped at ``max_loops``). The decision after
  loop ``t`` only reads gates ``g[0..t-1]``, so the host can schedule loop ``t+1`` before loop
  ``t``'s gate has come back.
- ``fixed``: ``max_loops`` loops.
- ``synthetic``: the number of loops is drawn deterministically from ``(seed, request id, token
  index)`` with a given mean, or replayed from a list, so that early-exit workloads can be
  benchmarked with random weights.

The scheduler folds gates lazily: :func:`gates_needed_at` says how many gates a decision reads,
:func:`gate_needed` whether a loop's gate can influence any decision at all (if not, the runner need
not copy it back), and :func:`coda_kind` whether a loop must sample a token (``certain``), may
have to (``speculative``: the exit is decided after the gate is read) or cannot (``none``).

Fused decode steps decide exits on the device: :func:`device_exit_params` turns a token's rule into
four per-row numbers (forced-exit loop count, ``min_loops``, delay, float32 threshold) and
:func:`decide_exit_rows` is the rule on them in float32, the numpy twin of
``ouro_jax.exit_rule.decide_exit_rows`` (the fake runner uses it).
"""

from __future__ import annotations

import hashlib
import math
from typing import Optional, Sequence

import numpy as np

from .sampling_params import SamplingParams

__all__ = [
    "sigmoid",
    "fold_gate",
    "threshold_reached",
    "gates_needed_at",
    "decide_exit",
    "gate_needed",
    "coda_kind",
    "synthetic_exit_loops",
    "reference_exit_loops",
    "device_exit_params",
    "fold_gate_rows",
    "decide_exit_rows",
]


def sigmoid(x: float) -> float:
    x = float(x)
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def fold_gate(remaining: float, gate_logit: float) -> float:
    """``remaining * (1 - sigmoid(g))``: the probability mass that has not exited yet."""
    return remaining * (1.0 - sigmoid(gate_logit))


def threshold_reached(loops_done: int, remaining: float, params: SamplingParams) -> bool:
    """The gate part of the ``ouro`` rule (without the ``max_loops`` cap)."""
    thr = params.exit_threshold
    return thr < 1.0 and loops_done >= params.min_loops and 1.0 - remaining >= thr


def gates_needed_at(params: SamplingParams, num_loops: int, loops_done: int) -> int:
    """How many gates (``g[0..k-1]``) the decision after ``loops_done`` loops reads; 0 when the
    decision does not depend on gates at all (forced exit, fixed depth, before ``min_loops``)."""
    if params.exit_threshold >= 1.0 or loops_done >= params.resolved_max_loops(num_loops):
        return 0
    if params.exit_mode == "ouro":
        return loops_done if loops_done >= params.min_loops else 0
    if params.exit_mode == "delayed":
        return loops_done - 1 if loops_done - 1 >= params.min_loops else 0
    return 0


def decide_exit(
    params: SamplingParams, num_loops: int, loops_done: int, remaining: float, target_loops: Optional[int] = None
) -> bool:
    """Exit after ``loops_done`` loops? ``remaining`` must have exactly ``gates_needed_at``
    gates folded in; ``target_loops`` is the synthetic draw (only read in synthetic mode)."""
    max_loops = params.resolved_max_loops(num_loops)
    if loops_done >= max_loops:
        return True
    mode = params.exit_mode
    if mode == "fixed":
        return False
    if mode == "synthetic":
        return loops_done >= target_loops
    if mode == "ouro":
        return threshold_reached(loops_done, remaining, params)
    if mode == "delayed":
        return threshold_reached(loops_done - 1, remaining, params)
    raise ValueError(f"unknown exit_mode {mode!r}")


def gate_needed(params: SamplingParams, num_loops: int, t: int) -> bool:
    """Can the gate of loop ``t`` (0-based) influence this token's exit?

    A decision at ``loops_done = max_loops`` is forced, so only decisions at ``L <= max_loops - 1``
    read gates: ``ouro`` reads ``g[t]`` at ``L >= max(t+1, min_loops)``, ``delayed`` at
    ``L >= max(t+2, min_loops+1)``. The needed gates always form a prefix ``g[0..k-1]``.
    """
    if params.exit_threshold >= 1.0:
        return False
    last = params.resolved_max_loops(num_loops) - 1
    if params.exit_mode == "ouro":
        return max(t + 1, params.min_loops) <= last
    if params.exit_mode == "delayed":
        return max(t + 2, params.min_loops + 1) <= last
    return False


def coda_kind(params: SamplingParams, num_loops: int, loops_done: int, target_loops: Optional[int] = None) -> str:
    """Must the invocation that runs loop ``loops_done - 1`` sample a token for this row?

    ``"certain"``: the token exits there whatever the gates say; ``"speculative"``: the exit is
    decided once the gate is read, so the coda runs anyway and its token is kept only on exit;
    ``"none"``: the token cannot exit there.
    """
    if loops_done >= params.resolved_max_loops(num_loops):
        return "certain"
    mode = params.exit_mode
    if mode == "fixed":
        return "none"
    if mode == "synthetic":
        return "certain" if loops_done >= target_loops else "none"
    if params.exit_threshold >= 1.0:
        return "none"
    if mode == "ouro":
        return "speculative" if loops_done >= params.min_loops else "none"
    if mode == "delayed":
        return "speculative" if loops_done - 1 >= params.min_loops else "none"
    raise ValueError(f"unknown exit_mode {mode!r}")


def _uniforms(seed: int, request_id, token_index: int, n: int) -> list[float]:
    """``n`` uniforms in [0, 1) from a keyed hash: the same on every machine and Python run
    (Python's ``hash`` is salted per process, numpy generators are too slow per token)."""
    out: list[float] = []
    block = 0
    while len(out) < n:
        h = hashlib.blake2b(f"{seed}|{request_id}|{token_index}|{block}".encode(), digest_size=64).digest()
        for i in range(0, 64, 8):
            out.append(int.from_bytes(h[i : i + 8], "little") / 2.0**64)
        block += 1
    return out[:n]


def synthetic_exit_loops(params: SamplingParams, num_loops: int, request_id, token_index: int) -> int:
    """Loops run by the decode step that produces generated token ``token_index`` (>= 1).

    Replay: ``synthetic_depths[token_index % len]`` is the exit depth (0-based loop), so replaying
    a recorded ``exit_depths`` list reproduces it (entry 0, the prompt's token, is always ``T-1``
    and is not read); the depth is clipped into ``[min_loops - 1, max_loops - 1]``.
    Draw: ``min_loops + Binomial(max_loops - min_loops, p)`` with ``p`` chosen so that the mean
    is ``synthetic_mean_loops``; the trials come from a hash of ``(seed, request_id, token_index)``.
    """
    lo, hi = params.min_loops, params.resolved_max_loops(num_loops)
    if params.synthetic_depths is not None:
        d = params.synthetic_depths[token_index % len(params.synthetic_depths)]
        return min(max(d + 1, lo), hi)
    if hi == lo:
        return lo
    p = (params.synthetic_mean_loops - lo) / (hi - lo)
    return lo + sum(u < p for u in _uniforms(params.seed, request_id, token_index, hi - lo))


def reference_exit_loops(
    params: SamplingParams, num_loops: int, gate_logits: Sequence[float], target_loops: Optional[int] = None
) -> int:
    """The number of loops a token runs given all its gates at once (a token-at-a-time reference
    for tests; the scheduler applies the same rule one loop at a time)."""
    remaining, folded = 1.0, 0
    for loops_done in range(1, num_loops + 1):
        need = gates_needed_at(params, num_loops, loops_done)
        while folded < need:
            remaining = fold_gate(remaining, gate_logits[folded])
            folded += 1
        if decide_exit(params, num_loops, loops_done, remaining, target_loops):
            return loops_done
    raise AssertionError("unreachable: max_loops <= T forces an exit")


_BELOW_ONE = np.nextafter(np.float32(1.0), np.float32(0.0))


def device_exit_params(
    params: SamplingParams, num_loops: int, target_loops: Optional[int] = None
) -> tuple[int, int, int, float]:
    """The rule of one token as a device decides it: ``(limit, min_loops, delay, threshold)``.

    ``limit``: loops after which the exit is forced (``max_loops``, or the synthetic draw, which
    lies in ``[min_loops, max_loops]``); ``delay`` 1 for ``delayed`` (the gate part reads
    ``loops_done - 1``); ``threshold`` as float32, 1.0 (off) for ``fixed`` and ``synthetic``. A
    threshold below 1 that float32 rounds to 1 is kept just below it, so it stays on.
    """
    mode, max_loops = params.exit_mode, params.resolved_max_loops(num_loops)
    if mode == "synthetic":
        return int(target_loops), params.min_loops, 0, 1.0
    thr = params.exit_threshold if mode in ("ouro", "delayed") else 1.0
    thr32 = np.float32(thr)
    if thr < 1.0 and thr32 >= 1.0:
        thr32 = _BELOW_ONE
    return max_loops, params.min_loops, int(mode == "delayed"), float(thr32)


def fold_gate_rows(remaining: np.ndarray, gate_logits: np.ndarray) -> np.ndarray:
    """``remaining * (1 - sigmoid(g))`` per row, in float32 as on the device."""
    g = np.asarray(gate_logits, np.float32)
    with np.errstate(over="ignore"):
        sig = np.float32(1.0) / (np.float32(1.0) + np.exp(-g))
    return (np.asarray(remaining, np.float32) * (np.float32(1.0) - sig)).astype(np.float32)


def decide_exit_rows(
    loops_done: int, remaining_now, remaining_before, limit, min_loops, delay, threshold
) -> np.ndarray:
    """Exit after ``loops_done`` loops, per row (float32): forced at ``limit``, else the gate rule
    of ``ouro`` (``delay`` 0, ``remaining_now`` with ``loops_done`` gates folded) or ``delayed``
    (``delay`` 1, ``remaining_before`` with one gate fewer). Arguments as ``device_exit_params``."""
    delay = np.asarray(delay)
    rem = np.where(delay == 1, remaining_before, remaining_now).astype(np.float32)
    thr = np.asarray(threshold, np.float32)
    gate = (thr < 1.0) & (loops_done - delay >= np.asarray(min_loops)) & (np.float32(1.0) - rem >= thr)
    return (loops_done >= np.asarray(limit)) | gate
