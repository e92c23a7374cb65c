"""The engine's attention backend: K/V written into the paged pool, then ragged paged attention.

Plugs into the model's attention boundary (``model.Attention``). The cache it threads is the pair
of stacked pools ``(K, V)``, each ``[L, KVH, num_blocks, block_size, hd]``; every layer writes its
rows' K/V at their slots (the slot already encodes the row's plane, via the plane's block table)
and attends per segment through the segment's block table. The kernel reads layer ``layer``
straight out of the stacked pool, so nothing slices the pool and the update stays in place.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from pallas_kernels import write_kv
from pallas_kernels.dispatch import AttentionKernel

__all__ = ["PagedAttention"]


@dataclasses.dataclass(frozen=True)
class PagedAttention:
    row_slot: jax.Array  # [R] flat slot of each row's K/V at its plane (-1 = padding)
    seg_q_start: jax.Array  # [S]
    seg_q_len: jax.Array  # [S]
    seg_ctx_len: jax.Array  # [S]
    seg_block_table: jax.Array  # [S, MB]
    scale: float
    kernel: AttentionKernel  # the bucket's choice (dispatch.choose_attention)
    plan: Any = None  # kernel.plan(...) of this invocation, shared by every layer

    def __call__(self, layer, q, k, v, cache):
        kp, vp = cache
        kp, vp = write_kv(kp, vp, k, v, self.row_slot, layer=layer)
        out = self.kernel(
            q,
            kp,
            vp,
            self.seg_q_start,
            self.seg_q_len,
            self.seg_ctx_len,
            self.seg_block_table,
            layer=layer,
            sm_scale=self.scale,
            plan=self.plan,
        )
        return out, (kp, vp)
