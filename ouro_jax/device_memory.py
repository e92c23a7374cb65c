"""What a device can still hold: the one query both the engine's pool sizing and ``generate()``'s
up-front cache check make before allocating."""

from __future__ import annotations

from typing import Optional

import jax


def device_memory(device=None) -> Optional[tuple[int, int]]:
    """``(bytes_limit, bytes_in_use)`` of ``device`` (default: the first one), or None where the
    backend has no stats (the CPU)."""
    try:
        stats = (device or jax.devices()[0]).memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory stats
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
