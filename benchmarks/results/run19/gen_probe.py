"""Where generate() b=1 spends a token on the GPU: trace calls of N=1 and N=33 new tokens, per-token
difference of kernels, busy time and gap sites (session 10 probe)."""

import json
import os
import sys
import time

import jax
import numpy as np

from benchmarks.profile_step import aggregate, trace_kernels
from ouro_jax import generate, get_preset
from ouro_jax.model import init_params

cfg = get_preset(os.environ.get("PRESET", "ouro-1.4b"))
params = init_params(cfg, 0, "bfloat16")
B = int(sys.argv[1]) if len(sys.argv) > 1 else 1
ids = np.random.default_rng(0).integers(1, cfg.vocab_size, (B, int(os.environ.get("P", 1024)))).astype(np.int32)
lens = np.full((B,), ids.shape[1], np.int32)
out = {}
for n in (1, 33):
    jax.block_until_ready(generate(params, cfg, ids, lens, n))  # compile + warm
    t = time.perf_counter()
    jax.block_until_ready(generate(params, cfg, ids, lens, n))
    wall = time.perf_counter() - t
    (_, plane, ev, info, _) = trace_kernels(lambda: jax.block_until_ready(generate(params, cfg, ids, lens, n)))
    agg = aggregate(ev, 1, top=12)
    out[n] = dict(
        wall_ms=wall * 1e3,
        kernels=agg["kernels"],
        busy_ms=agg["busy_ms_per_inv"],
        cats={k: (v["ms_per_inv"], v["count_per_inv"]) for k, v in agg["categories"].items()},
        gap_sites=agg["gap_sites"],
        top=[(k["name"], k["ms_per_inv"], k["count_per_inv"]) for k in agg["top_kernels"][:12]],
    )
d = 32 * 4  # loops in the 32 extra tokens
per_loop = dict(
    wall_ms=(out[33]["wall_ms"] - out[1]["wall_ms"]) / d,
    kernels=(out[33]["kernels"] - out[1]["kernels"]) / d,
    busy_ms=(out[33]["busy_ms"] - out[1]["busy_ms"]) / d,
    cats={
        k: (
            (out[33]["cats"][k][0] - out[1]["cats"].get(k, (0, 0))[0]) / d,
            (out[33]["cats"][k][1] - out[1]["cats"].get(k, (0, 0))[1]) / d,
        )
        for k in out[33]["cats"]
    },
)
print(
    f"generate() b={B}: per loop wall {per_loop['wall_ms']:.3f} ms, busy {per_loop['busy_ms']:.3f} ms,"
    f" kernels {per_loop['kernels']:.1f}"
)
for k, v in per_loop["cats"].items():
    print(f"   {k:16s} {v[0]:.3f} ms {v[1]:.1f}")
print("gap sites (N=33 call, whole call):")
for g in out[33]["gap_sites"][:10]:
    print(f"   {g['before'][:40]:40s} -> {g['after'][:40]:40s} {g['ms_per_inv']:.3f} ms x{g['count_per_inv']:.0f}")
for t in out[33]["top"]:
    print("   top", t)
json.dump(
    dict(per_loop=per_loop, calls=out),
    open(os.path.join(os.environ.get("OUT", "."), f"gen_probe_b{B}.json"), "w"),
    indent=1,
    default=str,
)
