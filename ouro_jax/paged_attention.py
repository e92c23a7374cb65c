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

from pallas_kernels import ragged_paged_attention_reference, write_kv
from pallas_kernels.dispatch import make_kernel_plan, paged_attention, select_kernel

__all__ = ["PagedAttention", "attention_plan", "resolve_impl"]


def resolve_impl(
    impl: str, num_rows: int, num_segments: int, dtype, head_dim: int, block_size: int, num_heads: int
) -> str:
    """``"pallas"`` becomes the Pallas kernel chosen for this bucket (``"triton"``, ``"mgpu"`` or
    ``"hybrid"``: long segments on Mosaic GPU, the rest on Triton, split per segment at run time;
    pallas_kernels/dispatch.py); other values (a forced kernel, ``"reference"``) pass through."""
    if impl == "pallas":
        return select_kernel(num_rows, num_segments, dtype, head_dim, block_size, num_heads=num_heads)
    return impl


def attention_plan(
    impl: str,
    num_rows: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seg_q_start,
    seg_q_len,
    seg_ctx_len,
    seg_block_table,
):
    """The kernel's work list, built once per invocation and shared by every layer (for
    ``"hybrid"`` both kernels' work lists and the row mask that merges their outputs)."""
    if impl == "reference":
        return None
    return make_kernel_plan(
        impl, num_rows, num_heads, num_kv_heads, head_dim, seg_q_start, seg_q_len, seg_ctx_len, seg_block_table
    )


@dataclasses.dataclass(frozen=True)
class PagedAttention:
    row_slot: jax.Array  # [R] flat slot of each row's K/V at its plane (-1 = padding)
    seg_q_start: jax.Array  # [S]
    seg_q_len: jax.Array  # [S]
    seg_ctx_len: jax.Array  # [S]
    seg_block_table: jax.Array  # [S, MB]
    scale: float
    impl: str = "reference"  # "triton" | "mgpu" | "hybrid" | "reference" (resolve_impl)
    interpret: bool = False
    plan: Any = None

    def __call__(self, layer, q, k, v, cache):
        kp, vp = cache
        kp, vp = write_kv(kp, vp, k, v, self.row_slot, layer=layer)
        args = (q, kp, vp, self.seg_q_start, self.seg_q_len, self.seg_ctx_len, self.seg_block_table)
        if self.impl != "reference":
            out = paged_attention(
                self.impl, *args, layer=layer, sm_scale=self.scale, interpret=self.interpret, plan=self.plan
            )
        else:
            out = ragged_paged_attention_reference(*args, layer=layer, sm_scale=self.scale)
        return out, (kp, vp)
