"""One rule for enum-like options (``kv_layout``, ``prefill_mode``, ``policy``, ``exit_mode``,
``attention``, dtypes): any case is accepted, anything else is a ``ValueError``
naming the option and its choices. It lives here, in the jax-free bottom layer, so that every layer
can use it."""

from __future__ import annotations

from typing import Sequence

__all__ = ["choice"]


def choice(name: str, value, choices: Sequence[str]) -> str:
    """``value`` lower-cased if it is one of ``choices`` (lower-case strings), else ``ValueError``."""
    if isinstance(value, str) and value.lower() in choices:
        return value.lower()
    raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)} (any case), got {value!r}")
