"""A decode layer's GEMMs at a few rows: XLA's kernels against the Mosaic GPU ones (issue 36).

Two blocks of a decode layer, each chained over ``n`` layers in one jit with what surrounds it:

* ``mlp``: the pre-MLP RMSNorm, the MLP, the post-MLP RMSNorm and the residual add. ``xla`` is the
  model's ``OuroMLP`` (gate/up GEMM, SiLU x up, down GEMM, with XLA's split-K reduces); ``mgpu`` is
  ``pallas_kernels.decode_mlp_mgpu`` (two launches; the down projection's split sum goes into the
  post-MLP norm's fusion).
* ``attn_proj``: the pre-attention RMSNorm, the fused Q/K/V projection, the O projection of its Q
  part (the attention itself left out: it is not a GEMM), the post-attention RMSNorm and the
  residual add. ``mgpu`` runs both projections with ``pallas_kernels.decode_gemm_mgpu``.

Each layer has its own weights (the preset's layers, cycled: Ouro-1.4B's 24 MLPs are 1.66 GB, far
past the L2). A layer is ``(t(2n) - t(n)) / n`` (``benchmarks/timing.py``: the jit's own launch
cancels). The floor is one read of the block's weights at the copy bandwidth measured in the same
run. Every ``mgpu`` record first checks one pass over the layers against ``xla``'s
(``max_rel_err``).

    python -m benchmarks.decode_gemm                      # rows 1 / 8 / 16, the kernels' defaults
    python -m benchmarks.decode_gemm --sweep --out DIR    # and the knobs around them, at 8 rows
    python -m benchmarks.decode_gemm --profile            # each chain's kernels traced too
    python -m benchmarks.decode_gemm --paths mgpu         # some of the paths only

``--profile``: one more call of each timed chain under the profiler; its record carries
``kernels``, a layer's kernels by name (``us_per_layer``, ``count_per_layer``), and their sum
``kernel_us_per_layer`` (device time alone: the wall-clock figure of a chain moved by up to 20%
between two calls of one run on the H200, run 33).

Writes ``<out>/decode_gemm.json``. Off a Hopper GPU only the ``xla`` paths run (a plumbing check).
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
from pallas_kernels.decode_gemm_mgpu import decode_gemm_mgpu, gemm_tuning
from pallas_kernels.decode_mlp_mgpu import decode_mlp_mgpu, mlp_tuning

__all__ = ["BLOCKS", "block_weights", "main", "sweep_knobs", "time_chain"]

BLOCKS = ("mlp", "attn_proj")
PATHS = ("xla", "mgpu")  # the Mosaic GPU paths run on a Hopper GPU only
EPS = 1e-6


def _rms(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS)


def _normal(key, shape, fan_in: int, dtype):
    return (jax.random.normal(key, shape, jnp.float32) / np.sqrt(fan_in)).astype(dtype)


def block_weights(block: str, config, layers: int, dtype=jnp.bfloat16, seed: int = 0) -> list:
    """``layers`` weight pairs of random weights: ``(w_gate_up [D, 2, I], w_down [I, D])`` (mlp) or
    ``(w_qkv [D, 3 Dq], w_o [Dq, D])`` (attn_proj, MHA: K and V as wide as Q)."""
    d, inter = config.hidden_size, config.intermediate_size
    dq = config.num_attention_heads * config.head_dim
    out = []
    for key in jax.random.split(jax.random.PRNGKey(seed), layers):
        k1, k2 = jax.random.split(key)
        if block == "mlp":
            out.append((_normal(k1, (d, 2, inter), d, dtype), _normal(k2, (inter, d), inter, dtype)))
        else:
            out.append((_normal(k1, (d, 3 * dq), d, dtype), _normal(k2, (dq, d), dq, dtype)))
    return out


def _block_fn(block: str, path: str, config, knobs: dict):
    """``f(h [M, D] in the weights' dtype, w1, w2) -> [M, D] float32``: the block between its norms."""
    if block == "mlp":
        if path == "mgpu":
            return functools.partial(decode_mlp_mgpu, **knobs)
        module = OuroMLP(config, jnp.bfloat16, fused=True)

        def mlp(h, w_gu, w_d):
            params = {"gate_up_proj": {"kernel": w_gu}, "down_proj": {"kernel": w_d}}
            return module.apply({"params": params}, h).astype(jnp.float32)

        return mlp
    dq = config.num_attention_heads * config.head_dim

    def attn_proj(h, w_qkv, w_o):
        if path != "xla":
            qkv = decode_gemm_mgpu(h, w_qkv, **knobs.get("qkv", {}))
            return decode_gemm_mgpu(qkv[:, :dq].astype(h.dtype), w_o, **knobs.get("o", {}))
        return jnp.dot(jnp.dot(h, w_qkv)[:, :dq], w_o).astype(jnp.float32)

    return attn_proj


def _chain(block: str, path: str, config, knobs: dict, n: int):
    """A jit of ``n`` layers' blocks over the weights, cycled: ``x [M, D]`` f32 in and out."""
    f = _block_fn(block, path, config, knobs)

    @jax.jit
    def run(x, weights):
        for i in range(n):
            w1, w2 = weights[i % len(weights)]
            x = x + _rms(f(_rms(x).astype(w1.dtype), w1, w2))
        return x

    return run


def time_chain(block, path, config, weights, rows: int, knobs: dict, n: int, reps: int) -> float:
    """Seconds per layer's ``block`` on ``path``."""
    x = jax.random.normal(jax.random.PRNGKey(1), (rows, config.hidden_size), jnp.float32)
    return per_call_s(lambda k: _chain(block, path, config, knobs, k), (x, weights), n, reps)


def _check(block, path, config, weights, rows: int, knobs: dict) -> float:
    """Relative max error of one pass over the layers on ``path`` against ``xla``."""
    x = jax.random.normal(jax.random.PRNGKey(2), (rows, config.hidden_size), jnp.float32)
    n = len(weights)
    want = np.asarray(_chain(block, "xla", config, {}, n)(x, weights))
    got = np.asarray(_chain(block, path, config, knobs, n)(x, weights))
    return float(np.abs(got - want).max() / max(1e-6, np.abs(want).max()))


def profile_chain(block, path, config, weights, rows: int, knobs: dict, n: int) -> list[dict]:
    """The kernels of one call of the ``n``-layer chain, by name: ``us_per_layer``,
    ``count_per_layer`` (``profile_step.trace_kernels`` and ``aggregate``, a layer as the
    invocation), the longest first."""
    from benchmarks.profile_step import aggregate, trace_kernels

    run = _chain(block, path, config, knobs, n)
    x = jax.random.normal(jax.random.PRNGKey(1), (rows, config.hidden_size), jnp.float32)
    jax.block_until_ready(run(x, weights))  # compiled and warm before the trace
    _, _, events, _, _ = trace_kernels(lambda: jax.block_until_ready(run(x, weights)))
    kernels = aggregate(events, n, top=64)["top_kernels"]
    return [
        dict(name=k["name"], us_per_layer=k["ms_per_inv"] * 1e3, count_per_layer=k["count_per_inv"]) for k in kernels
    ]


def sweep_knobs(block: str, config) -> list[dict]:
    """The defaults first, then the knobs around them."""
    d, inter = config.hidden_size, config.intermediate_size
    if block == "attn_proj":
        o = gemm_tuning(config.num_attention_heads * config.head_dim, d)
        out = [{}]
        out += [dict(o=dict(splits=s)) for s in (2, 8) if s != o.splits]
        out += [dict(qkv=dict(block_n=32)), dict(qkv=dict(splits=2)), dict(o=dict(block_n=32, splits=2))]
        out += [dict(qkv=dict(block_k=bk), o=dict(block_k=bk)) for bk in (64, 256)]
        return out
    t = mlp_tuning(d, inter)
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
    ap.add_argument("--blocks", nargs="*", choices=BLOCKS, default=list(BLOCKS))
    ap.add_argument("--rows", nargs="*", type=int, default=[1, 8, 16])
    ap.add_argument("--layers", type=int, default=None, help="weight sets cycled (default: the preset's layers)")
    ap.add_argument("--chain", type=int, default=24, help="n of the (t(2n) - t(n)) / n timing")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--sweep", action="store_true", help="also the kernel knobs around the defaults")
    ap.add_argument("--sweep-rows", nargs="*", type=int, default=[8], help="the rows the sweep runs at")
    ap.add_argument("--profile", action="store_true", help="trace each chain's kernels too")
    ap.add_argument("--paths", nargs="*", choices=PATHS, default=list(PATHS), help="the paths timed")
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    config = get_preset(a.preset)
    ceil = ceilings.measure(quick=True)
    paths = a.paths if dispatch.hopper_available() else [p for p in a.paths if p == "xla"]
    records = []
    for block in a.blocks:
        weights = block_weights(block, config, a.layers or config.num_hidden_layers)
        w_bytes = sum(w.nbytes for w in weights[0])
        floor_s = w_bytes / ceil["bandwidth"]
        for rows in a.rows:
            for path in paths:
                sweep = path != "xla" and a.sweep and rows in a.sweep_rows
                for knobs in sweep_knobs(block, config) if sweep else [{}]:
                    rec = dict(block=block, path=path, rows=rows, knobs=knobs, floor_us=floor_s * 1e6)
                    try:
                        if path != "xla":
                            rec["max_rel_err"] = _check(block, path, config, weights, rows, knobs)
                        s = time_chain(block, path, config, weights, rows, knobs, a.chain, a.reps)
                        rec.update(us_per_layer=s * 1e6, of_floor=floor_s / s)
                        if a.profile:
                            rec["kernels"] = profile_chain(block, path, config, weights, rows, knobs, a.chain)
                            rec["kernel_us_per_layer"] = sum(k["us_per_layer"] for k in rec["kernels"])
                    except Exception as e:  # noqa: BLE001 - a knob the kernel refuses is a record, not the end
                        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                    records.append(rec)
                    print(json.dumps(rec), flush=True)
        del weights
    out = dict(
        benchmark="decode_gemm",
        device=jax.devices()[0].device_kind,
        preset=a.preset,
        chain=a.chain,
        ceilings=ceil,
        records=records,
    )
    from benchmarks.run import save_json

    os.makedirs(a.out, exist_ok=True)
    save_json(out, os.path.join(a.out, "decode_gemm.json"))
    return out


if __name__ == "__main__":
    main()
