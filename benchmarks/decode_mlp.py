"""A decode layer's MLP at a few rows: XLA's kernels against the two Mosaic GPU kernels (issue 36).

A jit runs a chain of ``n`` layers' MLPs with what surrounds the MLP in a decode layer: the
pre-MLP RMSNorm, the MLP, the post-MLP RMSNorm and the residual add. Each layer has its own
weights (the preset's layers, cycled: Ouro-1.4B's 24 are 1.66 GB, far past the L2). A layer is
``(t(2n) - t(n)) / n`` (``benchmarks/timing.py``: the jit's own launch cancels). The floor is one
read of a layer's MLP weights at the copy bandwidth measured in the same run.

Paths: ``xla`` is the model's own ``OuroMLP`` (gate/up GEMM, SiLU x up, down GEMM, with XLA's
split-K reduces); ``mgpu`` is ``pallas_kernels.decode_mlp_mgpu`` (two launches; the down
projection's split sum goes into the post-MLP norm's fusion). Every ``mgpu`` record first checks
the chain's output against ``xla``'s (``max_rel_err``).

    python -m benchmarks.decode_mlp                      # rows 1 / 8 / 16, the kernels' defaults
    python -m benchmarks.decode_mlp --sweep --out DIR    # and the knobs around the defaults

Writes ``<out>/decode_mlp.json``. Off a Hopper GPU only the ``xla`` path runs (a plumbing check).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import ceilings
from benchmarks.timing import per_call_s
from ouro_jax import get_preset
from ouro_jax.model import OuroMLP
from pallas_kernels import dispatch
from pallas_kernels.decode_mlp_mgpu import decode_mlp_mgpu, mlp_tuning

__all__ = ["main", "mlp_weights", "time_chain"]

EPS = 1e-6


def _rms(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS)


def mlp_weights(config, layers: int, dtype=jnp.bfloat16, seed: int = 0) -> list:
    """``layers`` pairs ``(w_gate_up [D, 2, I], w_down [I, D])`` of random weights."""
    d, inter = config.hidden_size, config.intermediate_size
    out = []
    for key in jax.random.split(jax.random.PRNGKey(seed), layers):
        kg, kd = jax.random.split(key)
        w_gu = (jax.random.normal(kg, (d, 2, inter), jnp.float32) / np.sqrt(d)).astype(dtype)
        w_d = (jax.random.normal(kd, (inter, d), jnp.float32) / np.sqrt(inter)).astype(dtype)
        out.append((w_gu, w_d))
    return out


def _mlp_fn(path: str, config, knobs: dict):
    if path == "xla":
        module = OuroMLP(config, jnp.bfloat16, fused=True)

        def mlp(h, w_gu, w_d):
            params = {"gate_up_proj": {"kernel": w_gu}, "down_proj": {"kernel": w_d}}
            return module.apply({"params": params}, h).astype(jnp.float32)

        return mlp
    return functools.partial(decode_mlp_mgpu, **knobs)


def _chain(path: str, config, knobs: dict, n: int):
    """A jit of ``n`` decode-layer MLP blocks over the weights, cycled: ``x [M, D]`` f32 in and out."""
    mlp = _mlp_fn(path, config, knobs)

    @jax.jit
    def run(x, weights):
        for i in range(n):
            w_gu, w_d = weights[i % len(weights)]
            x = x + _rms(mlp(_rms(x).astype(w_gu.dtype), w_gu, w_d))
        return x

    return run


def time_chain(path: str, config, weights, rows: int, knobs: dict, n: int, reps: int) -> float:
    """Seconds per layer's MLP block on ``path``."""
    x = jax.random.normal(jax.random.PRNGKey(1), (rows, config.hidden_size), jnp.float32)
    return per_call_s(lambda k: _chain(path, config, knobs, k), (x, weights), n, reps)


def _check(config, weights, rows: int, knobs: dict) -> float:
    """Relative max error of one pass over the layers on ``mgpu`` against ``xla``."""
    x = jax.random.normal(jax.random.PRNGKey(2), (rows, config.hidden_size), jnp.float32)
    n = len(weights)
    want = np.asarray(_chain("xla", config, {}, n)(x, weights))
    got = np.asarray(_chain("mgpu", config, knobs, n)(x, weights))
    return float(np.abs(got - want).max() / max(1e-6, np.abs(want).max()))


def sweep_knobs(config) -> list[dict]:
    """The defaults, then block_k, the down splits, the stages and the CTA widths around them."""
    t = mlp_tuning(config.hidden_size, config.intermediate_size)
    out = [{}]
    for bk, splits in itertools.product((64, 128, 256), (2, 4, 8)):
        if (bk, splits) != (t.block_k, t.down.splits):
            out.append(dict(block_k=bk, down_splits=splits))
    out += [dict(gate_up_stages=s) for s in (2, 3) if s != t.gate_up_stages]
    out += [dict(down_stages=s) for s in (2, 4) if s != t.down.stages]
    # narrower CTAs: more of them (gate/up 176 at Ouro-1.4B), fewer down splits for the same count
    out += [dict(gate_up_block_n=32), dict(gate_up_block_n=32, gate_up_stages=3)]  # 1 or 2 CTAs an SM
    out += [dict(down_block_n=32, down_splits=2), dict(down_block_n=16, down_splits=1)]
    out += [dict(gate_up_block_n=32, down_block_n=32, down_splits=2)]
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--rows", nargs="*", type=int, default=[1, 8, 16])
    ap.add_argument("--layers", type=int, default=None, help="weight sets cycled (default: the preset's layers)")
    ap.add_argument("--chain", type=int, default=48, help="n of the (t(2n) - t(n)) / n timing")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also the kernel knobs around the defaults")
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    config = get_preset(a.preset)
    weights = mlp_weights(config, a.layers or config.num_hidden_layers)
    ceil = ceilings.measure(quick=True)
    w_bytes = 3 * config.hidden_size * config.intermediate_size * 2
    floor_s = w_bytes / ceil["bandwidth"]
    paths = ["xla"] + (["mgpu"] if dispatch.hopper_available() else [])
    records = []
    for rows in a.rows:
        for path in paths:
            for knobs in sweep_knobs(config) if (path == "mgpu" and a.sweep) else [{}]:
                rec = dict(path=path, rows=rows, knobs=knobs, floor_us=floor_s * 1e6)
                try:
                    if path == "mgpu":
                        rec["max_rel_err"] = _check(config, weights, rows, knobs)
                    s = time_chain(path, config, weights, rows, knobs, a.chain, a.reps)
                    rec.update(us_per_layer=s * 1e6, of_floor=floor_s / s)
                except Exception as e:  # noqa: BLE001 - a knob the kernel refuses is a record, not the end
                    rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                records.append(rec)
                print(json.dumps(rec), flush=True)
    out = dict(
        benchmark="decode_mlp",
        device=jax.devices()[0].device_kind,
        preset=a.preset,
        chain=a.chain,
        weight_bytes_per_layer=w_bytes,
        ceilings=ceil,
        records=records,
    )
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "decode_mlp.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
