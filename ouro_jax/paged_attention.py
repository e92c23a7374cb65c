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
from pallas_kernels.rope_write_kv import rope_write_kv

__all__ = ["PagedAttention", "fuses_norms", "fuses_rope"]


def fuses_rope(kernel: AttentionKernel) -> bool:
    """Whether layers with fused Q/K/V weights use the ``rope_write_kv`` kernel (one launch a layer
    where XLA runs three) with ``kernel``: wherever attention is a Pallas kernel (interpret mode
    too: the CPU tests). The ``reference`` attention (the CPU engine) keeps XLA's RoPE and scatters."""
    return kernel.name != "reference"


def fuses_norms(kernel: AttentionKernel) -> bool:
    """Whether layers add attention's normed output to the residual and norm the sum in one kernel
    (``pallas_kernels.residual_norm``) with ``kernel``: as ``fuses_rope``, wherever attention is a
    Pallas kernel; the ``reference`` attention keeps XLA's fusions."""
    return kernel.name != "reference"


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
    # RoPE and the K/V write in one kernel (``rope_write``, see ``model.Attention``); False: XLA's
    # RoPE and scatters (``__call__``). ``fuses_rope(kernel)`` says which the engine uses.
    fuses_rope: bool = False
    # the residual add and the next norm after attention in one kernel (``model.Attention``);
    # ``fuses_norms(kernel)`` says where the engine does
    fuses_norms: bool = False

    def __call__(self, layer, q, k, v, cache):
        kp, vp = cache
        kp, vp = write_kv(kp, vp, k, v, self.row_slot, layer=layer)
        return self.attend(layer, q, (kp, vp))

    def rope_write(self, layer, qkv, cos, sin, cache):
        """Rotated queries ``[R, H, hd]`` and the pools with the rows' rotated K and V written
        (``pallas_kernels.rope_write_kv``; ``qkv`` is the fused projection's ``[R, G, g + 2, hd]``)."""
        kp, vp = cache
        q, kp, vp = rope_write_kv(qkv, cos, sin, kp, vp, self.row_slot, layer=layer, interpret=self.kernel.interpret)
        return q, (kp, vp)

    def attend(self, layer, q, cache):
        """Attention of rotated queries over the pools (their rows' K/V already written)."""
        kp, vp = cache
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
