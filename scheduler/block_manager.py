"""KVBlockManager: which pages of the KV pool belong to which request, per plane, and the prefix cache.

The pool (owned by the runner, docs/contracts.md) holds ``num_blocks`` pages of ``block_size``
tokens per layer. LAST_EXITED gives every request one block table per depth plane (``T`` of them),
SHARED one; all planes draw from the same pool. Block 0 is the trash page that padding rows write
to, so it is never handed out.

The manager is the one owner of every block table: one dense array ``tables [slot, plane, block]``
(unused entries 0), one row ("slot") per request, handed out at ``allocate`` and given back by
``free``. The scheduler places a request's ring region by its slot and the descriptor builder reads
the array in place, so no table is ever copied or rebuilt elsewhere.

Tables grow one *column* at a time: column ``i`` is block ``i`` of every plane (positions
``i*bs .. (i+1)*bs - 1``). Every plane of a position is needed sooner or later (a token that exits
at ``e`` has its plane-``e`` K/V copied into the planes above), so the planes grow together. How
many columns a request takes at admission, and when it grows, is the scheduler's policy
(``SchedulerConfig.kv_allocation``, docs/decisions.md).

Prefix cache (``enable_prefix_caching``): a column of a request's prompt whose positions are final
in every plane can be *published* under the hash chain of the prompt's token ids up to its end
(``prefix_block_hashes``). A later request whose prompt starts with the same blocks takes those
columns by reference (``allocate(..., hashes=...)``). A cached column stays in the pool when its
last holder lets go ("idle"), and idle columns are evicted, least recently released first, only
when a request needs blocks that the free list cannot give. Reference counts are per block; the
blocks of one column are always held together.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Optional, Sequence

import numpy as np

from .sizes import blocks_per_plane

__all__ = ["KVBlockManager", "prefix_block_hashes", "DEFAULT_ENABLE_PREFIX_CACHING"]

# The engine's default for prefix caching (LLM and SchedulerConfig). It pays where prompts share
# prefixes (H200, shared_prefix: TTFT p50 5.0 s -> 0.26 s); its host cost where none do is not yet
# measured on the H200, so it stays off (docs/decisions.md). One constant: switching is one line.
DEFAULT_ENABLE_PREFIX_CACHING = False


def prefix_block_hashes(token_ids: np.ndarray, block_size: int, salt: bytes, num_blocks: int) -> list[bytes]:
    """Hash chain of the first ``num_blocks`` full blocks: ``h_i = H(h_{i-1}, tokens of block i)``,
    ``h_{-1} = salt``. A hash therefore names a block *and everything before it*."""
    out, h = [], salt
    ids = np.ascontiguousarray(np.asarray(token_ids, "<i4"))
    for i in range(num_blocks):
        h = hashlib.blake2b(h + ids[i * block_size : (i + 1) * block_size].tobytes(), digest_size=16).digest()
        out.append(h)
    return out


def leading_matches(hashes: Sequence[bytes], held) -> int:
    """How many leading entries of ``hashes`` are in ``held`` (a prefix cache's keys, or a mirror of them)."""
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


class KVBlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_planes: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        watermark: float = 0.0,
        enable_prefix_caching: bool = False,
    ):
        if not (isinstance(num_blocks, int) and num_blocks >= 2):
            raise ValueError(
                f"KVBlockManager: num_blocks must be an int >= 2 (block 0 is the trash page), got {num_blocks!r}"
            )
        if not (isinstance(block_size, int) and block_size >= 1):
            raise ValueError(f"KVBlockManager: block_size must be a positive int, got {block_size!r}")
        if not (isinstance(num_planes, int) and num_planes >= 1):
            raise ValueError(f"KVBlockManager: num_planes must be a positive int, got {num_planes!r}")
        for name, v in (("max_seqs", max_seqs), ("max_blocks_per_seq", max_blocks_per_seq)):
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"KVBlockManager: {name} must be a positive int, got {v!r}")
        if not (0.0 <= watermark < 1.0):
            raise ValueError(f"KVBlockManager: watermark must lie in [0, 1), got {watermark!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_planes = num_planes
        self.max_seqs = max_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.watermark = watermark
        self.enable_prefix_caching = bool(enable_prefix_caching)
        # blocks admission keeps free for the growth of running requests (on-demand allocation)
        self.watermark_blocks = int(watermark * (num_blocks - 1))
        # a stack: the most recently freed block is handed out first (warm in L2)
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))
        self._ref_count = np.zeros(num_blocks, np.int32)
        self._ref_count[0] = 1  # the trash page is permanently "in use"
        # every block table: [slot, plane, block]; a request's columns are 0.._num_cols[slot]-1
        self._table = np.zeros((max_seqs, num_planes, max_blocks_per_seq), np.int32)
        self._tables_view = self._table.view()
        self._tables_view.flags.writeable = False
        self._num_cols = np.zeros(max_seqs, np.int64)
        self._slot_of: dict[object, int] = {}  # request id -> its slot
        self._free_slots = list(range(max_seqs - 1, -1, -1))  # a stack: slot 0 first
        self._cached: dict[bytes, np.ndarray] = {}  # hash -> column
        self._hash_of: dict[int, bytes] = {}  # plane-0 block of a cached column -> its hash
        self._idle: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # held by nobody, LRU first
        # when a list: every change of the prefix cache, ``(hash, True)`` cached / ``(hash, False)``
        # evicted, appended in order; a data-parallel worker drains it to mirror its cache to the router
        self.cache_log: Optional[list] = None

    # ----------------------------------------------------------------- sizes
    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds: the free list plus idle cached columns (evictable on demand)."""
        return len(self._free) + len(self._idle) * self.num_planes

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests (the trash page not counted)."""
        return self.num_blocks - 1 - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache, held or idle."""
        return len(self._cached) * self.num_planes

    @property
    def capacity_blocks(self) -> int:
        """The most blocks one admission may ever take."""
        return self.num_blocks - 1 - self.watermark_blocks

    def blocks_per_plane(self, num_tokens: int) -> int:
        return blocks_per_plane(num_tokens, self.block_size)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks for ``num_tokens`` positions in every plane."""
        return self.blocks_per_plane(num_tokens) * self.num_planes

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_blocks - 1

    def num_held_tokens(self, request_id) -> int:
        """Positions the request's tables cover (every plane)."""
        return int(self._num_cols[self._slot_of[request_id]]) * self.block_size

    # ----------------------------------------------------------------- tables
    @property
    def tables(self) -> np.ndarray:
        """Every block table, ``[slot, plane, block]`` (read-only; entries past a request's columns
        and rows of no request are 0, the trash page). The descriptor builder gathers from it."""
        return self._tables_view

    def slot(self, request_id) -> int:
        """The request's row of ``tables`` (also its batch slot: the scheduler's ring region)."""
        return self._slot_of[request_id]

    def block_table(self, request_id) -> np.ndarray:
        """A copy of the request's table, ``[planes, blocks held]``."""
        slot = self._slot_of[request_id]
        return self._table[slot, :, : self._num_cols[slot]].copy()

    def holds(self, request_id) -> bool:
        return request_id in self._slot_of

    # ------------------------------------------------------------- prefix cache
    def num_cached_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` the cache holds."""
        return leading_matches(hashes, self._cached)

    def publish(self, request_id, column: int, h: bytes, shared: bool = False) -> bool:
        """Cache column ``column`` of ``request_id`` (final in every plane) under hash ``h``; False
        if ``h`` is cached already (the request keeps its own copy private) or caching is off.
        ``shared``: the prompt of a group of choices (``n``), published for its siblings even
        with caching off."""
        slot = self._slot_of[request_id]
        if not 0 <= column < self._num_cols[slot]:
            raise ValueError(f"KVBlockManager.publish: request {request_id!r} holds no column {column}")
        if not (self.enable_prefix_caching or shared) or h in self._cached:
            return False
        col = self._table[slot, :, column].copy()
        if int(col[0]) in self._hash_of:
            return False  # the column came from the cache
        self._cached[h] = col
        self._hash_of[int(col[0])] = h
        if self.cache_log is not None:
            self.cache_log.append((h, True))
        return True

    def _evict(self, n_blocks: int) -> None:
        while len(self._free) < n_blocks and self._idle:
            h, _ = self._idle.popitem(last=False)
            col = self._cached.pop(h)
            del self._hash_of[int(col[0])]
            if self.cache_log is not None:
                self.cache_log.append((h, False))
            self._free.extend(int(b) for b in col[::-1])

    def _take(self, n: int) -> list[int]:
        self._evict(n)
        out = self._free[len(self._free) - n :][::-1] if n else []
        del self._free[len(self._free) - n :]
        return out

    # ------------------------------------------------------------ allocation
    def allocate(
        self, request_id, num_tokens: int, hashes: Sequence[bytes] = (), keep_free: int = 0
    ) -> Optional[tuple[np.ndarray, int]]:
        """A slot and tables for positions ``0..num_tokens-1`` of a request that holds none: the
        leading blocks cached under ``hashes`` by reference, fresh blocks for the rest. None (nothing
        changed) if no slot is free or that would leave fewer than ``keep_free`` blocks free. Returns
        ``(table [planes, blocks], number of cached blocks used)``."""
        if request_id in self._slot_of:
            raise ValueError(f"KVBlockManager: request {request_id!r} already holds blocks")
        per_plane = self._check_len(request_id, num_tokens)
        if not self._free_slots:
            return None
        hits = [self._cached[h] for h in hashes[: self.num_cached_prefix(hashes[:per_plane])]]
        fresh = (per_plane - len(hits)) * self.num_planes
        idle_hit = sum(1 for h in hashes[: len(hits)] if h in self._idle) * self.num_planes
        if fresh + idle_hit > self.num_free_blocks - keep_free:
            return None
        for h, col in zip(hashes, hits):
            self._idle.pop(h, None)
            self._ref_count[col] += 1
        new = np.asarray(self._take(fresh), np.int32).reshape(-1, self.num_planes)
        self._ref_count[new.ravel()] += 1
        slot = self._free_slots.pop()
        self._slot_of[request_id] = slot
        if hits:
            self._table[slot, :, : len(hits)] = np.stack(hits, axis=1)
        self._table[slot, :, len(hits) : per_plane] = new.T
        self._num_cols[slot] = per_plane
        return self.block_table(request_id), len(hits)

    def _check_len(self, request_id, num_tokens: int) -> int:
        per_plane = self.blocks_per_plane(num_tokens)
        if per_plane > self.max_blocks_per_seq:
            raise ValueError(
                f"KVBlockManager: request {request_id!r} asks for {num_tokens} positions, a table holds "
                f"{self.max_blocks_per_seq} blocks of {self.block_size}"
            )
        return per_plane

    def grow(self, request_id, num_tokens: int) -> Optional[np.ndarray]:
        """Extend the request's tables to cover ``num_tokens`` positions; returns the new columns
        ``[planes, k]`` (``k`` may be 0), or None (nothing changed) if the pool cannot give them."""
        slot = self._slot_of[request_id]
        have = int(self._num_cols[slot])
        k = self._check_len(request_id, num_tokens) - have
        if k <= 0:
            return np.zeros((self.num_planes, 0), np.int32)
        if k * self.num_planes > self.num_free_blocks:
            return None
        new = np.asarray(self._take(k * self.num_planes), np.int32).reshape(k, self.num_planes)
        self._ref_count[new.ravel()] += 1
        self._table[slot, :, have : have + k] = new.T
        self._num_cols[slot] = have + k
        return new.T

    def free(self, request_id) -> None:
        """Give back every block of the request (no-op if it holds none). Cached columns stay in
        the cache, idle once nobody holds them; the request's last columns become idle first, so
        that eviction takes the ends of prefixes before their starts."""
        slot = self._slot_of.pop(request_id, None)
        if slot is None:
            return
        cols = self._table[slot, :, : self._num_cols[slot]].T.copy()
        self._table[slot] = 0
        self._num_cols[slot] = 0
        self._free_slots.append(slot)
        for col in cols[::-1]:
            self._ref_count[col] -= 1
            if self._ref_count[col[0]] == 0:
                h = self._hash_of.get(int(col[0]))
                if h is None:
                    self._free.extend(int(b) for b in col[::-1])
                else:
                    self._idle[h] = None

    def ref_counts(self) -> np.ndarray:
        """A copy of the per-block reference counts (tests check they return to zero)."""
        return self._ref_count.copy()
