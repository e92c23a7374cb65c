"""Dense attention backends for the model's attention boundary (see ``model.Attention``).

``DenseCausalAttention`` serves ``forward`` (no cache); ``DenseCacheAttention`` serves the jitted
static-batch ``generate``, whose cache per layer is ``(K, V)`` each ``[T, B, S_max, KVH, hd]``: one
plane per loop depth (LAST_EXITED). The engine's paged backend lives in ``ouro_jax/paged.py``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["dense_attention", "DenseCausalAttention", "DenseCacheAttention"]


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


@dataclasses.dataclass(frozen=True)
class DenseCacheAttention:
    """Attention through a dense per-loop cache ``(K, V)``, each ``[T, B, S_max, KVH, hd]``.

    ``prefill=True``: rows are ``[B, S]`` at positions ``0..S-1``; their K/V go to plane ``plane``
    at ``[:S]`` and attention is causal over them. ``prefill=False``: one row per sequence
    (``[B, 1]``) at ``positions[b]``; its K/V go to ``plane`` at that position and it attends to
    every position ``<= positions[b]`` of the plane.
    """

    plane: jax.Array
    positions: jax.Array  # [B] (decode) or unused (prefill)
    prefill: bool
    scale: float

    def __call__(self, layer, q, k, v, cache):
        """``cache`` is the list of per-layer ``(K, V)``; only entry ``layer`` changes."""
        kc, vc = cache[layer]
        t, b, smax = kc.shape[:3]
        if self.prefill:
            start = (self.plane, 0, 0, 0, 0)
            kc = jax.lax.dynamic_update_slice(kc, k[None].astype(kc.dtype), start)
            vc = jax.lax.dynamic_update_slice(vc, v[None].astype(vc.dtype), start)
            out = dense_attention(q, k, v, _causal_mask(q.shape[1], k.shape[1]), self.scale)
            return out, _replace(cache, layer, (kc, vc))
        rows = jnp.arange(b)
        kc = kc.at[self.plane, rows, self.positions].set(k[:, 0].astype(kc.dtype))
        vc = vc.at[self.plane, rows, self.positions].set(v[:, 0].astype(vc.dtype))
        kp = jax.lax.dynamic_index_in_dim(kc, self.plane, axis=0, keepdims=False)
        vp = jax.lax.dynamic_index_in_dim(vc, self.plane, axis=0, keepdims=False)
        mask = (jnp.arange(smax)[None, :] <= self.positions[:, None])[:, None, :]
        return dense_attention(q, kp, vp, mask, self.scale), _replace(cache, layer, (kc, vc))


def _replace(cache: list, layer: int, entry) -> list:
    out = list(cache)
    out[layer] = entry
    return out
