"""Rotary position embeddings: the one definition that the model and the ``rope_write_kv`` kernel share.

``rope_cos_sin`` gives the cos/sin tables ``[..., hd]`` (float32) of absolute positions; ``apply_rope``
rotates ``x [..., heads, hd]`` with them (halves split, not interleaved: ``x * cos + rotate_half(x) *
sin`` in float32, then the input's dtype). ``ouro_jax.model`` imports both; the kernel
(``rope_write_kv``) writes the same arithmetic per half and its ``rope_write_kv_reference`` twin
calls ``apply_rope``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["rope_cos_sin", "apply_rope"]


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin ``[..., hd]`` in float32 for absolute positions (identical in every loop)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x * cos + rotate_half(x) * sin`` (halves split, not interleaved); x is ``[..., heads, hd]``."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    # rotate_half, [-x2, x1]: the two halves reversed and multiplied by (-1, 1), an elementwise
    # expression for XLA (the same values as concatenating the halves)
    halves = jnp.flip(x32.reshape(*x.shape[:-1], 2, half), axis=-2)
    rot = (halves * jnp.array([-1.0, 1.0], jnp.float32)[:, None]).reshape(x.shape)
    return (x32 * cos[..., None, :] + rot * sin[..., None, :]).astype(x.dtype)
