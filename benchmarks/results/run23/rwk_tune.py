"""Session 14: rope_write_kv alone on Ouro-1.4B shapes, rows_per_program x num_warps, R = 8 / 1024
(jit with donated pools, 200 calls, median of 5 batches), against XLA's RoPE + two scatters."""

import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from ouro_jax.model import rope_cos_sin
from pallas_kernels.rope_write_kv import rope_write_kv, rope_write_kv_reference

L, G, hd, BS = int(__import__("os").environ.get("L", 24)), 16, 128, 16
NB = int(__import__("os").environ.get("NB", 8192))
kp = jnp.zeros((L, G, NB, BS, hd), jnp.bfloat16)
vp = jnp.zeros((L, G, NB, BS, hd), jnp.bfloat16)
rng = np.random.default_rng(0)
for R in (8, 1024):
    qkv = jnp.asarray(rng.standard_normal((R, G, 3, hd)), jnp.bfloat16)
    cos, sin = rope_cos_sin(jnp.arange(R) + 3000, hd, 1e6)
    slots = jnp.asarray(rng.permutation(NB * BS)[:R].astype(np.int32))
    variants = [("xla", None, None)] + [("kernel", rp, nw) for rp, nw in itertools.product((8, 16, 32, 64), (2, 4, 8))]
    for name, rp, nw in variants:
        if name == "xla":
            fn = lambda q, c, s, k, v, sl, lyr: rope_write_kv_reference(q, c, s, k, v, sl, layer=lyr)
        else:
            fn = lambda q, c, s, k, v, sl, lyr, rp=rp, nw=nw: rope_write_kv(
                q, c, s, k, v, sl, layer=lyr, rows_per_program=rp, num_warps=nw
            )

        def many(q, c, s, k, v, sl, fn=fn):
            def body(i, kv):
                out, k2, v2 = fn(q, c, s, kv[0], kv[1], sl, i % L)
                return (k2, v2, kv[2] + out)  # q used: XLA cannot drop its RoPE

            return jax.lax.fori_loop(0, 200, body, (k, v, jnp.zeros((q.shape[0], q.shape[1], q.shape[3]), q.dtype)))

        f = jax.jit(many, donate_argnums=(3, 4))
        kp, vp, _ = f(qkv, cos, sin, kp, vp, slots)
        jax.block_until_ready(kp)
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            kp, vp, _ = f(qkv, cos, sin, kp, vp, slots)
            jax.block_until_ready(kp)
            ts.append((time.perf_counter() - t) / 200 * 1e6)
        print(f"R={R} {name} rows/prog={rp} warps={nw}: {np.median(ts):.2f} us a call", flush=True)
