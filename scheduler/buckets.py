"""BucketSpec: the finite set of descriptor shapes, so the runner compiles every executable once.

Every descriptor array's shape is a function of the row bucket ``R``:

- ``S = R`` segments (every segment holds at least one row),
- ``P = R`` prelude tokens (a prompt token is embedded in the invocation that runs its depth 0,
  a decode token likewise),
- ``C = min(R, coda_cap)`` coda rows, ``coda_cap`` = ``max_num_seqs`` (plus ``extra_coda_rows``)
  rounded up to a power of two (at most one coda row per running request, and with self-speculative
  decoding one loop-by-loop verify's other positions),
- ``F = C * (T - 1)`` finalize pairs (LAST_EXITED; 0 for SHARED): each token that exited early in
  the previous invocation copies its KV into at most ``T - 1`` later planes. The scheduler picks
  ``R`` large enough for the pending pairs (``R >= ceil(pairs / (T - 1))``).
- ``MB = ceil(max_model_len / block_size)`` block-table columns, fixed.

Row buckets default to powers of two from 8 (a single-row executable is slower than eight rows on
the H200, docs/performance.md) up to ``max_num_batched_tokens`` rounded up.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import NamedTuple, Optional, Sequence

from .sizes import blocks_per_plane

__all__ = ["BucketKey", "BucketSpec", "next_power_of_two"]


def next_power_of_two(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class BucketKey(NamedTuple):
    R: int  # rows (also prelude tokens P)
    S: int  # segments
    C: int  # coda rows
    F: int  # finalize pairs
    MB: int  # block-table columns
    # every segment holds at least M rows: the runner's long-segment variant of a bucket (the same
    # shapes, another attention kernel: pallas_kernels/dispatch.py); 1 for any descriptor
    M: int = 1

    @property
    def P(self) -> int:
        """Prelude entries: one per row at most (a token is embedded where its depth 0 runs)."""
        return self.R


@dataclasses.dataclass(frozen=True)
class BucketSpec:
    max_num_batched_tokens: int
    max_num_seqs: int
    num_loops: int
    max_model_len: int
    block_size: int
    has_finalize: bool = True  # LAST_EXITED; SHARED never copies planes
    row_buckets: Optional[Sequence[int]] = None
    extra_coda_rows: int = 0  # a loop-by-loop verify's positions beyond its request's one coda row

    def __post_init__(self):
        rows = self.row_buckets
        if rows is None:
            top = next_power_of_two(max(8, self.max_num_batched_tokens))
            rows = []
            b = 8
            while b <= top:
                rows.append(b)
                b *= 2
        rows = tuple(int(r) for r in rows)
        if not rows or any(r < 1 for r in rows) or any(a >= b for a, b in zip(rows, rows[1:])):
            raise ValueError(f"BucketSpec: row buckets must be strictly increasing positive ints, got {rows}")
        if rows[-1] < self.max_num_batched_tokens:
            raise ValueError(
                f"BucketSpec: the largest row bucket ({rows[-1]}) is smaller than "
                f"max_num_batched_tokens ({self.max_num_batched_tokens})"
            )
        object.__setattr__(self, "row_buckets", rows)

    @property
    def coda_cap(self) -> int:
        return next_power_of_two(self.max_num_seqs + self.extra_coda_rows)

    @property
    def max_blocks_per_seq(self) -> int:
        return blocks_per_plane(self.max_model_len, self.block_size)

    def key_for_bucket(self, rows: int) -> BucketKey:
        c = min(rows, self.coda_cap)
        f = c * (self.num_loops - 1) if self.has_finalize else 0
        return BucketKey(R=rows, S=rows, C=c, F=f, MB=self.max_blocks_per_seq)

    def key_for(self, num_rows: int) -> BucketKey:
        """The smallest key whose row bucket holds ``num_rows``."""
        i = bisect.bisect_left(self.row_buckets, max(1, num_rows))
        if i == len(self.row_buckets):
            raise ValueError(f"BucketSpec: {num_rows} rows exceed the largest bucket {self.row_buckets[-1]}")
        return self.key_for_bucket(self.row_buckets[i])

    def keys(self) -> list[BucketKey]:
        """Every key a run can produce: the runner compiles one executable per key at start-up."""
        return [self.key_for_bucket(r) for r in self.row_buckets]
