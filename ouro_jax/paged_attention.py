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

from pallas_kernels import decode_gemm_mgpu, decode_mlp_mgpu, dispatch, write_kv
from pallas_kernels.dispatch import AttentionKernel
from pallas_kernels.rope_write_kv import rope_write_kv
from weights.config import OuroConfig

__all__ = ["PagedAttention", "decode_gemms", "fuses_norms", "fuses_rope"]


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


def decode_gemms(kernel: AttentionKernel, num_rows: int, dtype, config: OuroConfig) -> bool:
    """Whether a bucket of ``num_rows`` rows runs its layers' Q/K/V and O projections and MLP on
    the Mosaic decode GEMMs (``pallas_kernels.decode_gemm_mgpu``, ``decode_mlp_mgpu``): on Hopper,
    in 16-bit floats, up to their ``MAX_ROWS`` rows, with ``kernel`` a Pallas attention (their
    split-K partials are summed in ``rope_write_kv`` and ``residual_norm``, which come with it).
    One launch for the MLP's gate/up and SiLU x up, one for its down projection, none of XLA's
    split-K reduces: docs/roadmap.md has the kernel times."""
    if not (fuses_rope(kernel) and fuses_norms(kernel) and dispatch.hopper_available()):
        return False
    c = config
    qkv_cols = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    return all(
        why is None
        for why in (
            decode_gemm_mgpu.supported(dtype, num_rows, c.hidden_size, qkv_cols),
            decode_gemm_mgpu.supported(dtype, num_rows, c.q_size, c.hidden_size),
            decode_mlp_mgpu.supported(dtype, num_rows, c.hidden_size, c.intermediate_size),
        )
    )


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
    # the layers' projections and MLP on the Mosaic decode GEMMs (``model.Attention``);
    # ``decode_gemms(kernel, ...)`` says where the engine does
    decode_gemms: bool = False

    def __call__(self, layer, q, k, v, cache):
        kp, vp = cache
        kp, vp = write_kv(kp, vp, k, v, self.row_slot, layer=layer)
        return self.attend(layer, q, (kp, vp))

    def rope_write(self, layer, qkv, cos, sin, cache, out_dtype=None):
        """Rotated queries ``[R, H, hd]`` and the pools with the rows' rotated K and V written
        (``pallas_kernels.rope_write_kv``; ``qkv`` is the fused projection's ``[R, G, g + 2, hd]``,
        or its float32 split-K partials with the ``out_dtype`` their sum rounds to)."""
        kp, vp = cache
        q, kp, vp = rope_write_kv(
            qkv, cos, sin, kp, vp, self.row_slot, layer=layer, out_dtype=out_dtype, interpret=self.kernel.interpret
        )
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
