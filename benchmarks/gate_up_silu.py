"""SwiGLU's gate/up GEMM and SiLU x up at prompt-sized row counts: XLA's two kernels against the
Mosaic GPU kernel with SiLU x up in its epilogue (``pallas_kernels/gate_up_silu_mgpu.py``, issue 37).

Each path is timed as kernel device time (CUPTI, ``jax.experimental.mosaic.gpu.profiler.measure``:
the sum of a call's kernels, median over ``--iters`` calls), on one layer's random weights in the
engine's ``[D, 2, I]`` layout. ``xla`` is what the model runs without the kernel (the GEMM, then the
SiLU x up fusion); ``mgpu`` the kernel at its default knobs and at the knob sets of ``--sweep``.
The floor is the GEMM's FLOPs at the matmul ceiling measured in the same run. Each ``mgpu`` record
first checks its output against the jnp twin (``max_abs_err``).

    python -m benchmarks.gate_up_silu [--rows 256 512 1024 2048] [--sweep] [--out DIR]

Writes ``<out>/gate_up_silu.json``. Off a Hopper GPU it refuses (the kernel needs one).
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
from benchmarks.timing import kernel_us
from pallas_kernels import dispatch
from pallas_kernels.gate_up_silu_mgpu import Tuning, gate_up_silu, gate_up_silu_reference
from weights.config import get_preset

# knob sets around the defaults (5 stages of 128 x 64 tiles, or 6 of 64-row ones, exceed the H100's
# 227 KiB of shared memory: run 39)
SWEEP = [
    dict(stages=3),
    dict(minor_n=False),
    dict(snake_width=4),
    dict(minor_n=False, snake_width=8),
    dict(block_m=64),
    dict(block_k=32, stages=6),
    dict(block_k=32, stages=8),
    dict(block_k=128, stages=2),
]


@jax.jit
def xla_gate_up(x, w):
    """The model's fused path without the kernel (``OuroMLP``): one GEMM, then SiLU x up."""
    y = jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())))
    return jax.nn.silu(y[:, 0]) * y[:, 1]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--rows", nargs="*", type=int, default=[256, 512, 1024, 2048])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also the knob sets around the defaults")
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    if not dispatch.hopper_available():
        raise SystemExit("gate_up_silu needs a Hopper GPU")
    cfg = get_preset(a.preset)
    D, I = cfg.hidden_size, cfg.intermediate_size
    ceil = ceilings.measure(quick=True)
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((D, 2, I)) / np.sqrt(D), jnp.bfloat16)
    records = []
    for rows in a.rows:
        x = jnp.asarray(rng.standard_normal((rows, D)), jnp.bfloat16)
        floor_us = 2 * rows * D * 2 * I / ceil["peak_flops"] * 1e6
        want = np.asarray(gate_up_silu_reference(x, w), np.float32)
        knob_sets = [{}] + (SWEEP if a.sweep else [])
        for path, knobs in [("xla", {})] + [("mgpu", k) for k in knob_sets]:
            rec = dict(path=path, rows=rows, knobs=knobs, floor_us=floor_us)
            try:
                if path == "xla":
                    fn = xla_gate_up
                else:
                    tuning = dataclasses.replace(Tuning(), **knobs)
                    fn = jax.jit(lambda x, w, t=tuning: gate_up_silu(x, w, t))
                    rec["max_abs_err"] = float(np.max(np.abs(np.asarray(fn(x, w), np.float32) - want)))
                us = kernel_us(fn, x, w, iters=a.iters)
                rec.update(kernel_us=us, of_floor=floor_us / us)
            except Exception as e:  # noqa: BLE001 - a knob set the kernel refuses is a record, not the end
                rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            records.append(rec)
            print(json.dumps(rec), flush=True)
    out = dict(
        benchmark="gate_up_silu", device=jax.devices()[0].device_kind, preset=a.preset, ceilings=ceil, records=records
    )
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "gate_up_silu.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
