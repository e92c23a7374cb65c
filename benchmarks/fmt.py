"""Number formats of the benchmarks' printed tables and of REPORT.md: one rule each."""

from __future__ import annotations

__all__ = ["num", "ms", "pct"]


def num(x, missing: str = "-") -> str:
    """Readable at any magnitude: 12,345 / 12.35 / 0.0123; ``missing`` for None or NaN."""
    if x is None or x != x:
        return missing
    a = abs(x)
    return f"{x:,.0f}" if a >= 100 else f"{x:.2f}" if a >= 1 else f"{x:.3g}"


def ms(seconds, missing: str = "-") -> str:
    """``seconds`` in milliseconds, as ``num``."""
    return missing if seconds is None else num(seconds * 1e3, missing)


def pct(x, missing: str = "-", width: int = 0) -> str:
    """A fraction as a percentage: one decimal, two significant digits below 0.1%."""
    if x is None:
        return missing
    spec = f"{width}.1f" if width else ".1f"
    return f"{100 * x:{spec}}%" if x >= 0.001 or x == 0 else f"{100 * x:.2g}%"
