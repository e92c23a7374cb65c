"""Shared by the model tests and the engine tests of the exit rule."""

from scheduler.exit_policy import fold_gate


def gates_near_threshold(gates, threshold, min_loops, max_loops, mode) -> bool:
    """Some threshold test the host makes lies within float32 noise of the threshold."""
    if mode == "fixed" or threshold >= 1.0:
        return False
    remaining = 1.0
    for k, g in enumerate(gates[: max_loops - 1], start=1):
        remaining = fold_gate(remaining, g)
        if k >= min_loops and abs((1.0 - remaining) - threshold) < 1e-5:
            return True
    return False
