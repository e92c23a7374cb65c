"""Does uploading a descriptor wait for the compute stream? Times device_put of int32 arrays while
a long jitted loop runs, plain and staged through pinned host memory, and a small call on the result."""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

dev = jax.devices()[0]
N = int(os.environ.get("N", 8192))
x = jnp.ones((N, N), jnp.bfloat16)
long = jax.jit(lambda x: jax.lax.fori_loop(0, 40, lambda i, y: (y @ x) * 0.001, x))
small = jax.jit(lambda a: a[:8] + 1)
long(x).block_until_ready()
t = time.perf_counter()
long(x).block_until_ready()
LONG = time.perf_counter() - t
print(f"long op alone {LONG * 1e3:.1f} ms")
try:
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    on_device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
except Exception as e:  # noqa: BLE001
    pinned = None
    print("no pinned_host:", e)
for n in [2048, 8192, 16384, 32768, 65536, 131072, 262144]:
    a = np.arange(n, dtype=np.int32)
    small(jax.device_put(a, dev)).block_until_ready()
    for how in ("device_put", "pinned", "call_numpy"):
        if how == "pinned" and pinned is None:
            continue
        r = long(x)
        t = time.perf_counter()
        if how == "device_put":
            b = jax.device_put(a, dev)
        elif how == "pinned":
            try:
                b = jax.device_put(jax.device_put(a, pinned), on_device)
            except Exception as e:  # noqa: BLE001
                print("pinned path failed:", str(e)[:120])
                pinned = None
                r.block_until_ready()
                continue
        else:
            b = a
        t1 = time.perf_counter() - t
        out = small(b)
        t2 = time.perf_counter() - t
        out.block_until_ready()
        t3 = time.perf_counter() - t
        r.block_until_ready()
        print(
            f"{n * 4:>8} B {how:>10}: upload returned {t1 * 1e3:7.2f} ms, call returned {t2 * 1e3:7.2f} ms, "
            f"result {t3 * 1e3:7.2f} ms (long op {LONG * 1e3:.0f} ms)"
        )
