"""Dense attention for the model's attention boundary (see ``model.Attention``).

``DenseCausalAttention`` serves ``forward`` (no cache) and the static ``generate``'s prefill (which
also writes the K/V into its paged pool). The paged backend of the engine and of ``generate``'s
decode lives in ``ouro_jax/paged_attention.py``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["dense_attention", "DenseCausalAttention"]


def dense_attention(q, k, v, mask, scale):
    """Masked attention with GQA; softmax in float32.

    q ``[B, Sq, H, hd]``, k/v ``[B, Sk, KVH, hd]``, mask broadcastable to ``[B, Sq, Sk]`` (True = attend).
    """
    b, sq, h, hd = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, sq, kvh, h // kvh, hd)
    s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[:, None, None, :, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(mask[:, None, None, :, :], p, 0.0)  # rows with no key at all give zeros, not NaN
    o = jnp.einsum("bkgqs,bskd->bqkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, sq, h, hd).astype(q.dtype)


def _causal_mask(sq, sk):
    return (jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None])[None]


@dataclasses.dataclass(frozen=True)
class DenseCausalAttention:
    """Plain causal self-attention over the rows' own keys (``[B, S]`` rows); cache unused."""

    scale: float | None = None

    def __call__(self, layer, q, k, v, cache):
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        return dense_attention(q, k, v, _causal_mask(q.shape[1], k.shape[1]), scale), cache
