"""Tuning pass of the Mosaic GPU attention kernel: block_kv x pipeline stages on long prefill
segments (H200), each configuration also checked against the jnp reference (relative L2 error).
Usage: PYTHONPATH=. python3 benchmarks/mgpu_tune.py OUT.json"""
import time, statistics, json, sys, jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, '.')
from benchmarks.attention_sweep import build_case, SCALE
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention_mgpu import ragged_paged_attention_mgpu


def main(out_path):
  res = []
  for n, ql, ctx in [(1, 1024, 8192), (4, 2048, 2048), (1, 1024, 32768)]:
    c = build_case(jax.random.PRNGKey(0), n, ql, ctx)
    args = (c["q"], c["k"], c["v"], c["seg"]["q_start"], c["seg"]["q_len"], c["seg"]["ctx_len"], c["seg"]["tables"])
    want = ragged_paged_attention_reference(*args, layer=jnp.int32(0), sm_scale=SCALE)
    for bkv, st in [(64, 2), (64, 3), (64, 4), (128, 2), (128, 3)]:
      err = None
      try:
        @jax.jit
        def f(q, k, v, a, b, cc, d):
          for i in range(4):
            q = ragged_paged_attention_mgpu(q, k, v, a, b, cc, d, layer=jnp.int32(i % c["layers"]), sm_scale=SCALE, block_kv=bkv, max_concurrent_steps=st)
          return q
        one = ragged_paged_attention_mgpu(*args, layer=jnp.int32(0), sm_scale=SCALE, block_kv=bkv,
                                          max_concurrent_steps=st)
        err = float(jnp.linalg.norm((one - want).astype(jnp.float32))
                    / jnp.linalg.norm(want.astype(jnp.float32)))
        jax.block_until_ready(f(*args)); jax.block_until_ready(f(*args))
        ts = []
        for _ in range(5):
          t = time.perf_counter(); jax.block_until_ready(f(*args)); ts.append(time.perf_counter() - t)
        ms = statistics.median(ts) * 1e3 / 4
      except Exception as e:
        ms = None; print('fail', bkv, st, type(e).__name__, str(e)[:200])
      res.append(dict(shape=(n, ql, ctx), block_kv=bkv, stages=st, ms=ms, rel_err_vs_reference=err))
      print(res[-1], flush=True)
  json.dump(dict(device=jax.devices()[0].device_kind, records=res), open(out_path, 'w'), indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
