"""Does a lax.cond at the end of a program block the caller until the device reaches it?
And what does always sampling (sort over the vocabulary) cost per invocation?"""

import json
import os
import time

import jax
import jax.numpy as jnp
from jax import lax

from ouro_jax.sampling import sample

x = jnp.ones((8192, 8192), jnp.bfloat16) * 0.001


def work(x):
    for _ in range(8):
        x = (x @ x) * 0.01
    return x


def with_cond(x, t):
    y = work(x)[:8, :64].astype(jnp.float32)
    return lax.cond(jnp.any(t > 0), lambda y: jnp.sort(y, axis=-1), lambda y: y, y)


def plain(x, t):
    return work(x)[:8, :64].astype(jnp.float32)


res = {}
t = jnp.zeros((8,), jnp.float32)
for name, f in (("cond", with_cond), ("plain", plain)):
    f = jax.jit(f)
    jax.block_until_ready(f(x, t))
    rets, dones = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        out = f(x, t)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        rets.append(t1 - t0)
        dones.append(t2 - t0)
    res[name] = {"call_returns_ms": 1e3 * min(rets), "done_ms": 1e3 * min(dones)}
    print(name, res[name], flush=True)

V = 49152
for C in (8, 128):
    logits = jax.random.normal(jax.random.PRNGKey(0), (C, V), jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(1), C)
    keys = (
        jax.vmap(lambda k: jax.random.key_data(k))(keys)
        if hasattr(jax.random, "key_data") and keys.dtype != jnp.uint32
        else keys
    )
    for temp in (0.0, 0.7):
        tt = jnp.full((C,), temp, jnp.float32)
        tk = jnp.zeros((C,), jnp.int32)
        tp = jnp.full((C,), 0.9, jnp.float32)
        f = jax.jit(lambda l, a, b, c, k: sample(l, a, b, c, k))
        jax.block_until_ready(f(logits, tt, tk, tp, keys))
        t0 = time.perf_counter()
        for _ in range(50):
            o = f(logits, tt, tk, tp, keys)
        jax.block_until_ready(o)
        res[f"sample C={C} temp={temp}"] = 1e3 * (time.perf_counter() - t0) / 50
        print(f"sample C={C} temp={temp}: {res[f'sample C={C} temp={temp}']:.3f} ms/call", flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "cond_probe.json"), "w"), indent=1)
