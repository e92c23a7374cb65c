"""The per-token exit rule on the device: the jnp twin of ``scheduler/exit_policy.py``.

The host rule (``scheduler.exit_policy``) is the definition; this module states the same rule on
arrays so that every device path that decides exits (``static_generate``, ``full_forward``) uses
one formula. ``tests/model/test_exit_rule.py`` checks the two against each other on random gates.
``synthetic`` exits are drawn on the host only; a fused decode step gets each row's draw as the
forced-exit count of :func:`decide_exit_rows` (``scheduler.exit_policy.device_exit_params``).

``remaining`` after ``k`` gates is ``prod_{i<k} (1 - sigmoid(g_i))`` (float32 here, float64 on the
host); the decision after ``loops_done`` loops reads ``loops_done`` gates in ``ouro`` mode and
``loops_done - 1`` in ``delayed`` mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["DEVICE_EXIT_MODES", "fold_gate", "decide_exit", "decide_exit_rows", "exit_loops"]

#: Exit modes a device path can decide (``synthetic`` draws its depths on the host).
DEVICE_EXIT_MODES = ("ouro", "delayed", "fixed")


def _check_mode(exit_mode: str) -> None:
    if exit_mode not in DEVICE_EXIT_MODES:
        raise ValueError(f"exit_mode must be one of {DEVICE_EXIT_MODES} on the device, got {exit_mode!r}")


def fold_gate(remaining, gate_logit):
    """``remaining * (1 - sigmoid(g))``: the probability mass that has not exited yet."""
    return remaining * (1.0 - jax.nn.sigmoid(gate_logit.astype(jnp.float32)))


def _threshold_reached(loops_done, remaining, threshold, min_loops):
    return (threshold < 1.0) & (loops_done >= min_loops) & (1.0 - remaining >= threshold)


def decide_exit(loops_done, remaining, threshold, min_loops, max_loops, exit_mode: str = "ouro"):
    """Exit after ``loops_done`` loops? ``remaining`` has the gates the mode reads folded in
    (``loops_done`` for ``ouro``, ``loops_done - 1`` for ``delayed``, none for ``fixed``)."""
    _check_mode(exit_mode)
    forced = loops_done >= max_loops
    if exit_mode == "fixed":
        return forced
    if exit_mode == "delayed":
        return forced | _threshold_reached(loops_done - 1, remaining, threshold, min_loops)
    return forced | _threshold_reached(loops_done, remaining, threshold, min_loops)


def decide_exit_rows(loops_done, remaining_now, remaining_before, limit, min_loops, delay, threshold):
    """Per-row rule of a fused decode step, every mode at once (``[R]`` arrays from
    ``scheduler.exit_policy.device_exit_params``): forced after ``limit`` loops, else the gate
    rule of ``ouro`` (``delay`` 0: ``remaining_now``, ``loops_done`` gates) or ``delayed``
    (``delay`` 1: ``remaining_before``, one gate fewer); ``threshold >= 1`` turns the gate off."""
    rem = jnp.where(delay == 1, remaining_before, remaining_now)
    return (loops_done >= limit) | _threshold_reached(loops_done - delay, rem, threshold, min_loops)


def exit_loops(gate_logits, threshold, min_loops, max_loops, exit_mode: str = "ouro"):
    """Loops each token runs (``1..max_loops``) given all its gates ``[T, ...]`` at once."""
    _check_mode(exit_mode)
    g = jnp.asarray(gate_logits)
    t = g.shape[0]
    surv = jnp.cumprod(1.0 - jax.nn.sigmoid(g.astype(jnp.float32)), axis=0)
    # remaining[k]: after k gates, k = 0..T
    remaining = jnp.concatenate([jnp.ones_like(surv[:1]), surv], axis=0)
    done = jnp.arange(1, t + 1).reshape((t,) + (1,) * (g.ndim - 1))
    rem = remaining[:-1] if exit_mode == "delayed" else remaining[1:]
    exits = jnp.broadcast_to(decide_exit(done, rem, threshold, min_loops, max_loops, exit_mode), g.shape)
    exits = exits.at[t - 1].set(True)  # max_loops <= T: the last loop always exits
    return (jnp.argmax(exits, axis=0) + 1).astype(jnp.int32)
