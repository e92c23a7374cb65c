"""KVBlockManager: which pages of the KV pool belong to which request, per plane.

The pool (owned by the runner, docs/contracts.md) holds ``num_blocks`` pages of ``block_size``
tokens per layer. LAST_EXITED gives every request one block table per depth plane (``T`` of them),
SHARED one; all planes draw from the same pool. Block 0 is the trash page that padding rows write
to, so it is never handed out.

A request reserves, at admission, every block it can ever need (its whole prompt plus every
generated token that will get KV, in every plane). A running request therefore never meets an
exhausted pool and nothing has to be preempted mid-run; the price is that admission is
conservative. Ref counts are kept per block so that prefix caching (a block shared by several
requests, published by hash) and preemption (free and later re-reserve) can be added without
changing how tables are handed out.
"""

from __future__ import annotations

import numpy as np

__all__ = ["KVBlockManager"]


class KVBlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_planes: int, watermark: float = 0.0):
        if not (isinstance(num_blocks, int) and num_blocks >= 2):
            raise ValueError(
                f"KVBlockManager: num_blocks must be an int >= 2 (block 0 is the trash page), got {num_blocks!r}"
            )
        if not (isinstance(block_size, int) and block_size >= 1):
            raise ValueError(f"KVBlockManager: block_size must be a positive int, got {block_size!r}")
        if not (isinstance(num_planes, int) and num_planes >= 1):
            raise ValueError(f"KVBlockManager: num_planes must be a positive int, got {num_planes!r}")
        if not (0.0 <= watermark < 1.0):
            raise ValueError(f"KVBlockManager: watermark must lie in [0, 1), got {watermark!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_planes = num_planes
        self.watermark = watermark
        # blocks admission keeps free (a margin for later prefix-cache / preemption policies)
        self.watermark_blocks = int(watermark * (num_blocks - 1))
        # a stack: the most recently freed block is handed out first (warm in L2)
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))
        self._ref_count = np.zeros(num_blocks, np.int32)
        self._ref_count[0] = 1  # the trash page is permanently "in use"
        self._tables: dict[object, np.ndarray] = {}

    # ----------------------------------------------------------------- sizes
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests (the trash page not counted)."""
        return self.num_blocks - 1 - len(self._free)

    @property
    def capacity_blocks(self) -> int:
        """The most blocks one admission may ever take."""
        return self.num_blocks - 1 - self.watermark_blocks

    def blocks_per_plane(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks for ``num_tokens`` positions in every plane."""
        return self.blocks_per_plane(num_tokens) * self.num_planes

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.capacity_blocks

    # ------------------------------------------------------------ allocation
    def can_allocate(self, request) -> bool:
        return self.blocks_needed(request.max_kv_tokens) <= len(self._free) - self.watermark_blocks

    def allocate(self, request) -> np.ndarray:
        """Reserve every block ``request`` can ever need; returns its tables ``[planes, blocks]``."""
        rid = request.request_id
        if rid in self._tables:
            raise ValueError(f"KVBlockManager: request {rid!r} already holds blocks")
        if not self.can_allocate(request):
            raise RuntimeError(
                f"KVBlockManager: not enough free blocks for request {rid!r} "
                f"({self.blocks_needed(request.max_kv_tokens)} needed, "
                f"{len(self._free)} free, watermark {self.watermark_blocks})"
            )
        per_plane = self.blocks_per_plane(request.max_kv_tokens)
        n = per_plane * self.num_planes
        blocks = self._free[-n:][::-1] if n else []
        del self._free[len(self._free) - n :]
        table = np.asarray(blocks, np.int32).reshape(self.num_planes, per_plane)
        self._ref_count[table.ravel()] += 1
        self._tables[rid] = table
        return table

    def free(self, request) -> None:
        """Give back every block of ``request`` (no-op if it holds none)."""
        table = self._tables.pop(request.request_id, None)
        if table is None:
            return
        flat = table.ravel()
        self._ref_count[flat] -= 1
        # blocks shared with another holder (prefix caching) stay allocated
        released = flat[self._ref_count[flat] == 0]
        self._free.extend(int(b) for b in released[::-1])

    def block_table(self, request_id) -> np.ndarray:
        return self._tables[request_id]

    def holds(self, request_id) -> bool:
        return request_id in self._tables
