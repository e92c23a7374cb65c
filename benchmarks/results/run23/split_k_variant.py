"""ARCHIVED (run 23 call 5, measured slower, not in the engine): it was ``ouro_jax/split_k.py``, the
``decode_matmul="splitk"`` option. c=1 / c=8 fixed TPOT 6.08 / 7.48 ms against XLA's own split
5.91 / 7.31 ms in the same call (``call5.log``).

Split-K products whose partial sums the consumer adds: small-bucket o_proj and down_proj.

At 1-16 rows a projection with 2048 output columns has only 16 column tiles of 128, too few to
stream its weight at the GPU's bandwidth, so XLA's autotuner splits K: the GEMM writes 8 partial
products in float32 and a reduce kernel sums them before the RMSNorm fusion reads the result. On
the H200 that reduce is a launch-bound kernel of ~1.35 us after every o_proj and down_proj of a
decode layer (run 23, ``results/run23/``), ~0.26 ms of a token at 4 loops x 24 layers.

``split_k_matmul`` writes the split itself: ``x [m, K]`` and ``w [K, N]`` are viewed as ``S``
slices of ``K / S`` (free reshapes), one batched dot gives the ``[S, m, N]`` float32 partials, and
``S - 1`` explicit adds sum them. Adds are elementwise, so XLA fuses them into the consumer (the
residual add and RMSNorm fusion) instead of running a reduce kernel; the batched dot keeps the
same ``S x N / 128`` tiles of work as XLA's own split. The sum is rounded once to ``x``'s dtype,
as the dot's output is. Only 2-D weights with ``N <= MAX_COLUMNS`` are split (o_proj and
down_proj; the fused Q/K/V and gate/up kernels are 3-D and keep XLA's dot).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["split_k_matmul", "split_count", "TARGET_TILES", "MAX_COLUMNS"]

# Column tiles of 128 times splits to aim at: ~one tile per SM of an H200 (132), XLA's own choice
# for these shapes (8 splits x 16 tiles at N = 2048).
TARGET_TILES = 128
# Wider outputs already have enough column tiles: no split.
MAX_COLUMNS = 4096
# Each slice of K at least this long.
MIN_SLICE = 128


def split_count(k: int, n: int) -> int:
    """Slices of K for an ``[m, k] @ [k, n]`` product (1: no split): enough to reach
    ``TARGET_TILES`` tiles of 128 columns, a power of two dividing ``k`` in slices of at least
    ``MIN_SLICE``."""
    if n > MAX_COLUMNS:
        return 1
    s = 1
    while s * 2 * max(1, n // 128) <= TARGET_TILES and k % (s * 2) == 0 and k // (s * 2) >= MIN_SLICE:
        s *= 2
    return s


def split_k_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` (``x [m, K]``, ``w [K, *out]``) in ``x``'s dtype; 2-D ``w`` of at most
    ``MAX_COLUMNS`` columns as explicit split-K partials (module docstring), else XLA's dot."""
    m, k = x.shape
    n = math.prod(w.shape[1:])
    s = split_count(k, n) if w.ndim == 2 else 1
    if s == 1:
        return jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())))
    xs = x.reshape(m, s, k // s)
    ws = w.reshape(s, k // s, n)
    parts = jnp.einsum("msk,skn->smn", xs, ws, preferred_element_type=jnp.float32)
    out = parts[0]
    for i in range(1, s):
        out = out + parts[i]
    return out.astype(x.dtype)
