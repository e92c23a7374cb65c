"""The fused Q/K/V projection, RoPE and the K/V write at prompt-sized row counts: XLA's GEMM and the
``rope_write_kv`` kernel (what the engine runs) against the Mosaic GPU GEMM with RoPE in its
epilogue (``pallas_kernels/qkv_rope_mgpu.py``, issue 37) and the K/V write after it.

Each path is timed as kernel device time (CUPTI, ``jax.experimental.mosaic.gpu.profiler.measure``:
each kernel of a call, median over ``--iters`` calls), on one layer's random weights in the engine's
``[D, G, g + 2, hd]`` layout and a pool of ``--pool-rows`` slots a KV head (not donated, so XLA
copies it before the in-place write: kernels named ``copy`` are listed but left out of the sum,
as in the engine's step, which owns its pools). ``xla`` is the engine's
path (the GEMM, then ``rope_write_kv``); ``xla_gemm`` the GEMM alone; ``mgpu`` the kernel, then
``write_kv_rows`` (the same write without the rotation), at the default knobs and at the knob sets
of ``--sweep``. The floor is the GEMM's FLOPs at the matmul ceiling measured in the same run. Each
``mgpu`` record first checks the kernel's output against its jnp twin (``max_abs_err``).

    python -m benchmarks.qkv_rope [--rows 1024 2048] [--sweep] [--out DIR]

Writes ``<out>/qkv_rope.json``. Off a Hopper GPU it refuses (the kernel needs one).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import ceilings
from benchmarks.timing import kernels_us
from ouro_jax.model import qkv_groups
from pallas_kernels import dispatch
from pallas_kernels.qkv_rope_mgpu import Tuning, qkv_rope, qkv_rope_reference
from pallas_kernels.rope import rope_cos_sin
from pallas_kernels.rope_write_kv import rope_write_kv, write_kv_rows
from weights.config import get_preset

# knob sets around the defaults: two heads a tile (XLA's 128 x 256 tiles), 3 stages, the snake
SWEEP = [
    dict(heads=2),
    dict(heads=2, stages=3),
    dict(stages=3),
    dict(minor_n=False),
    dict(snake_width=4),
    dict(minor_n=False, snake_width=8),
    dict(block_m=64, heads=2),
    dict(block_k=128, stages=2),
]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--rows", nargs="*", type=int, default=[1024, 2048])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--pool-rows", type=int, default=4096, help="slots a KV head in the pool (one layer)")
    ap.add_argument("--sweep", action="store_true", help="also the knob sets around the defaults")
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    if not dispatch.hopper_available():
        raise SystemExit("qkv_rope needs a Hopper GPU")
    cfg = get_preset(a.preset)
    D, hd = cfg.hidden_size, cfg.head_dim
    G, g = qkv_groups(cfg)
    ceil = ceilings.measure(quick=True)
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((D, G, g + 2, hd)) / np.sqrt(D), jnp.bfloat16)
    bs = 16
    pool = jnp.zeros((1, G, a.pool_rows // bs, bs, hd), jnp.bfloat16)
    records = []

    @jax.jit
    def xla_path(x, w, cos, sin, kp, vp, slots):
        qkv = jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())))
        return rope_write_kv(qkv, cos, sin, kp, vp, slots, layer=0)

    @jax.jit
    def xla_gemm(x, w):
        return jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())))

    for rows in a.rows:
        x = jnp.asarray(rng.standard_normal((rows, D)), jnp.bfloat16)
        pos = jnp.asarray(rng.integers(0, 8192, rows), jnp.int32)
        cos, sin = rope_cos_sin(pos, hd, cfg.rope_theta)
        slots = jnp.asarray(rng.permutation(a.pool_rows)[:rows], jnp.int32)
        floor_us = 2 * rows * D * G * (g + 2) * hd / ceil["peak_flops"] * 1e6
        want_q, want_kv = (np.asarray(o, np.float32) for o in qkv_rope_reference(x, w, cos, sin))
        knob_sets = [{}] + (SWEEP if a.sweep else [])
        runs = [("xla", {}), ("xla_gemm", {})] + [("mgpu", k) for k in knob_sets]
        for path, knobs in runs:
            rec = dict(path=path, rows=rows, knobs=knobs, floor_us=floor_us)
            try:
                if path == "xla":
                    fn, args = xla_path, (x, w, cos, sin, pool, pool, slots)
                elif path == "xla_gemm":
                    fn, args = xla_gemm, (x, w)
                else:
                    tuning = dataclasses.replace(Tuning(), **knobs)

                    @jax.jit
                    def fn(x, w, cos, sin, kp, vp, slots, t=tuning):
                        q, kv = qkv_rope(x, w, cos, sin, t)
                        return q, *write_kv_rows(kv, kp, vp, slots, layer=0)

                    args = (x, w, cos, sin, pool, pool, slots)
                    q, kv = jax.jit(lambda x, w, c, s, t=tuning: qkv_rope(x, w, c, s, t))(x, w, cos, sin)
                    rec["max_abs_err"] = max(
                        float(np.max(np.abs(np.asarray(q, np.float32) - want_q))),
                        float(np.max(np.abs(np.asarray(kv, np.float32) - want_kv))),
                    )
                per_kernel = kernels_us(fn, *args, iters=a.iters)
                us = sum(v for name, v in per_kernel.items() if "copy" not in name)
                rec.update(kernel_us=us, kernels=per_kernel, gemm_of_floor=floor_us / us)
            except Exception as e:  # noqa: BLE001 - a knob set the kernel refuses is a record, not the end
                rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            records.append(rec)
            print(json.dumps(rec), flush=True)
    device = jax.devices()[0].device_kind
    out = dict(benchmark="qkv_rope", device=device, preset=a.preset, ceilings=ceil, records=records)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "qkv_rope.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
