"""The names of the attention choices, free of jax so that CLIs list them without importing it.

``pallas_kernels.dispatch`` re-exports them; it is where the choices are acted on.
"""

from __future__ import annotations

__all__ = ["KERNELS", "ATTENTION", "check_attention"]

#: The Pallas kernels a bucket can run.
KERNELS = ("triton", "mgpu", "hybrid")
#: Values of the ``attention`` option.
ATTENTION = ("auto", "pallas", *KERNELS, "reference")


def check_attention(name, choices: tuple = ATTENTION, what: str = "attention") -> str:
    """The one check of an ``attention`` value: ``name`` lower-cased, or a ``ValueError``."""
    value = name.strip().lower() if isinstance(name, str) else None
    if value not in choices:
        raise ValueError(f"{what} must be one of {choices} (any case), got {name!r}")
    return value
