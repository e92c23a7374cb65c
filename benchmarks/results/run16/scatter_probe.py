"""write_kv: atomic (non-unique) vs unique-index scatter, per layer of a [L, KVH, NB, BS, hd] pool."""

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv_cache import write_kv

L, KVH, NB, BS, HD = 24, 16, 8192, 16, 128
shape = (L, KVH, NB, BS, HD)


def write_old(kp, vp, k, v, slots, layer):
    n = NB * BS
    idx = jnp.where((slots >= 0) & (slots < n), slots, n)

    def upd(p, new):
        flat = p.reshape(L, KVH, n, HD)
        return flat.at[layer, :, idx].set(new.astype(p.dtype), mode="drop").reshape(shape)

    return upd(kp, k), upd(vp, v)


def bench(fn, R, reps=50):
    @jax.jit
    def many(kp, vp, k, v, slots):
        def body(i, c):
            kp, vp = c
            return fn(kp, vp, k, v, slots, i % L)

        return jax.lax.fori_loop(0, 48, body, (kp, vp))

    many = jax.jit(many, donate_argnums=(0, 1))
    kp = jnp.zeros(shape, jnp.bfloat16)
    vp = jnp.zeros(shape, jnp.bfloat16)
    rng = np.random.default_rng(0)
    slots = np.sort(rng.choice(NB * BS, size=R, replace=False)).astype(np.int32)
    slots[R // 2 : R // 2 + R // 8] = -1  # some padding
    k = jnp.asarray(rng.standard_normal((R, KVH, HD)), jnp.bfloat16)
    v = k + 1
    slots = jnp.asarray(slots)
    kp, vp = many(kp, vp, k, v, slots)
    jax.block_until_ready(kp)
    t = time.perf_counter()
    for _ in range(reps // 10):
        kp, vp = many(kp, vp, k, v, slots)
    jax.block_until_ready(kp)
    per = (time.perf_counter() - t) / (reps // 10) / 48
    return per, kp, vp


out = {}
for R in (8, 64, 256, 1024, 2048):
    a, ka, va = bench(write_old, R)
    b, kb, vb = bench(lambda *x: write_kv(*x[:5], layer=x[5]), R)
    same = bool(jnp.array_equal(ka, kb) and jnp.array_equal(va, vb))
    out[R] = {
        "atomic_us_per_layer": a * 1e6,
        "unique_us_per_layer": b * 1e6,
        "same": same,
        "bytes_per_layer": 2 * R * KVH * HD * 2,
    }
    print(R, out[R], flush=True)
    del ka, va, kb, vb
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "scatter_probe.json"), "w"), indent=1)
