"""Derived sizes: each computed here once and asked for everywhere else (scheduler, engine, runner).

Pure integer arithmetic, no state: ``SchedulerConfig``, ``BucketSpec``, the block manager, the
descriptor builder and ``LLM`` (which sizes the KV pool before any config exists) all call these.
"""

from __future__ import annotations

__all__ = ["kv_planes", "blocks_per_plane", "pool_blocks", "descriptor_rows", "ring_slots", "ring_rows"]


def kv_planes(num_loops: int, kv_layout: str) -> int:
    """KV depth planes per request: one per loop for LAST_EXITED, one for SHARED."""
    return num_loops if str(kv_layout).lower() == "last_exited" else 1


def blocks_per_plane(num_tokens: int, block_size: int) -> int:
    """KV blocks (pages) that hold ``num_tokens`` positions of one plane."""
    return -(-int(num_tokens) // int(block_size))


def pool_blocks(num_seqs: int, num_tokens: int, num_planes: int, block_size: int) -> int:
    """KV pool pages that hold ``num_seqs`` sequences of ``num_tokens`` positions in every plane,
    plus the trash page 0."""
    return int(num_seqs) * int(num_planes) * blocks_per_plane(num_tokens, block_size) + 1


def descriptor_rows(num_rows: int, num_prelude: int, num_coda: int, num_finalize: int, num_loops: int) -> int:
    """The row bucket a descriptor needs: one row per row, prelude and coda entry, and a bucket
    of ``R`` rows holds ``R * (T - 1)`` finalize pairs (``BucketSpec``: ``F = C * (T - 1)``)."""
    return max(num_rows, num_prelude, num_coda, -(-num_finalize // max(1, num_loops - 1)))


def ring_slots(num_loops: int, prefill_mode: str) -> int:
    """Prompt chunks of one request resident in its ring region at once: ``T`` for wavefront
    (a chunk per depth in flight), 1 for mixed and split."""
    return int(num_loops) if prefill_mode == "wavefront" else 1


def ring_rows(max_num_seqs: int, rows_per_request: int) -> int:
    """Rows of the hidden-state ring: scratch row 0, then one region per sequence."""
    return 1 + max_num_seqs * rows_per_request
