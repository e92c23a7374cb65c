"""Engine options checked by name before any work: the choices of each enum-like option and the one
case-insensitive rule (:func:`scheduler.options.choice`) that every layer applies to them."""

from __future__ import annotations

import numpy as np

from scheduler.options import choice

__all__ = ["choice", "dtype_option", "DTYPES"]

# ``attention`` is checked by ``pallas_kernels.dispatch.check_attention`` (its choices live there).
DTYPES = ("bfloat16", "float32", "float16")


def dtype_option(dtype, name: str = "dtype") -> str | None:
    """``None``, a name in any case, or a numpy/jax dtype -> ``None`` or one of :data:`DTYPES`."""
    if dtype is None or isinstance(dtype, str):
        return None if dtype is None else choice(name, dtype, DTYPES)
    try:
        return choice(name, np.dtype(dtype).name, DTYPES)
    except TypeError:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, DTYPES))} or None, got {dtype!r}") from None
