"""Tuning pass of the Mosaic GPU attention kernel: block_kv x pipeline stages on long prefill
segments (H200), each configuration also checked against the jnp reference (relative L2 error).
Cases, timing and error come from benchmarks/attention_sweep.py.

Usage: PYTHONPATH=. python3 benchmarks/mgpu_tune.py OUT.json
"""

import json
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from benchmarks.attention_sweep import SCALE, build_case, rel_err, timeit  # noqa: E402
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference  # noqa: E402
from pallas_kernels.ragged_paged_attention_mgpu import ragged_paged_attention_mgpu  # noqa: E402

SHAPES = [(1, 1024, 8192), (4, 2048, 2048), (1, 1024, 32768)]  # segments, rows, context
CONFIGS = [(64, 2), (64, 3), (64, 4), (128, 2), (128, 3)]  # block_kv, max_concurrent_steps
N_CALLS = 4


def chained(layers, block_kv, steps):
    """N_CALLS dependent launches in one jit, layers cycled (as attention_sweep times them)."""

    @jax.jit
    def f(q, k, v, qs, ql, cl, bt):
        for i in range(N_CALLS):
            q = ragged_paged_attention_mgpu(
                q,
                k,
                v,
                qs,
                ql,
                cl,
                bt,
                layer=jnp.int32(i % layers),
                sm_scale=SCALE,
                block_kv=block_kv,
                max_concurrent_steps=steps,
            )
        return q

    return f


def main(out_path):
    res = []
    for n, ql, ctx in SHAPES:
        c = build_case(jax.random.PRNGKey(0), n, ql, ctx)
        seg = c["seg"]
        args = (c["q"], c["k"], c["v"], seg["q_start"], seg["q_len"], seg["ctx_len"], seg["tables"])
        want = ragged_paged_attention_reference(*args, layer=jnp.int32(0), sm_scale=SCALE)
        for bkv, st in CONFIGS:
            rec = dict(shape=(n, ql, ctx), block_kv=bkv, stages=st, ms=None, rel_err_vs_reference=None)
            try:
                got = ragged_paged_attention_mgpu(
                    *args, layer=jnp.int32(0), sm_scale=SCALE, block_kv=bkv, max_concurrent_steps=st
                )
                rec["rel_err_vs_reference"] = rel_err(got, want)
                rec["ms"] = timeit(chained(c["layers"], bkv, st), args, N_CALLS, 5)
            except Exception as e:  # noqa: BLE001  (a configuration that does not fit is a result)
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            res.append(rec)
            print(rec, flush=True)
    with open(out_path, "w") as fh:
        json.dump(dict(device=jax.devices()[0].device_kind, records=res), fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
