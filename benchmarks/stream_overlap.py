"""Does a bandwidth-bound kernel overlap a GEMM when XLA runs it on a second stream?

Wavefront prefill at chunk 64 spends about half of each invocation in attention that reads K/V at
the bandwidth roofline and the other half in GEMMs at the FLOP ceiling, one after the other, so the
engine sits near its *sequential bound* (docs/roadmap.md, "Wavefront prefill"); the floor assumes
the two overlap. Two row groups of one invocation are independent within a layer, so one group's
attention could run beside the other's MLP, if the device runs them at once. jax 0.11.2 can put a
computation on another stream: ``jax.experimental.compute_on.compute_on(compute_type="gpu_stream:N")``
(XLA's ``_xla_stream_annotation``). This measures, in one process, two chains of calls alone, one
after the other in one jit, and with the second chain on stream 1:

* ``xla``: an elementwise pass over ``--bw-gib`` GiB (bandwidth-bound) beside a square bf16 GEMM;
* ``engine`` (GPU): the Mosaic attention kernel on 16 segments of 64 rows at 4K context (the
  wavefront chunk-64 shape) beside the gate/up projection of a 1024-row invocation of Ouro-1.4B.

``overlap`` = (alone + alone - together) / the shorter alone: 0 when nothing overlaps, 1 when the
shorter hides entirely under the longer.

    python -m benchmarks.stream_overlap --out /tmp/stream_overlap.json
    python -m benchmarks.stream_overlap --smoke          # CPU plumbing check, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
from jax.experimental.compute_on import compute_on

from benchmarks.timing import per_call_s

__all__ = ["main", "measure_pair", "on_stream"]


def on_stream(fn, stream: int):
    """``fn`` placed on GPU stream ``stream`` (outputs in device memory)."""
    return compute_on(compute_type=f"gpu_stream:{stream}", out_memory_spaces=jax.memory.Space.Device)(fn)


def measure_pair(first, second, a0, b0, n: int, reps: int) -> dict:
    """Per-call ms of ``first`` chained on ``a0`` alone, ``second`` chained on ``b0`` alone, both in
    one jit, and both with ``second`` on stream 1 (``per_call_s``: the jit's launch cancelled)."""

    def chain(step_a, step_b):
        def make(m):
            @jax.jit
            def f(a, b):
                for _ in range(m):
                    a = a if step_a is None else step_a(a)
                    b = b if step_b is None else step_b(b)
                return a, b

            return f

        return make

    args = (a0, b0)
    rec = {}
    for name, make in (
        ("first_ms", chain(first, None)),
        ("second_ms", chain(None, second)),
        ("one_stream_ms", chain(first, second)),
        ("second_on_stream_1_ms", chain(first, on_stream(second, 1))),
    ):
        try:
            rec[name] = per_call_s(make, args, n, reps) * 1e3
        except Exception as e:  # noqa: BLE001 - the record says which variant failed
            rec[name] = None
            rec.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:300]}"
    alone = (rec["first_ms"], rec["second_ms"])
    if None not in alone:
        for k in ("one_stream_ms", "second_on_stream_1_ms"):
            if rec[k] is not None:
                rec[k.replace("_ms", "_overlap")] = (sum(alone) - rec[k]) / min(alone)
    return rec


def xla_pair(n: int, bw_elems: int):
    a = jnp.full((n, n), 0.01, jnp.bfloat16)
    x = jnp.ones((bw_elems,), jnp.bfloat16)
    return (lambda y: (y @ a).astype(jnp.bfloat16)), (lambda v: v * 1.0001 + 1e-3), a, x


def engine_pair(key):
    from benchmarks.attention_sweep import SCALE, build_case
    from pallas_kernels import ragged_paged_attention_mgpu as mgpu

    c = build_case(key, 16, 64, 4096)
    s = c["seg"]
    packing = mgpu.make_packing(s["q_start"], s["q_len"], s["ctx_len"], s["tables"], num_rows=c["q"].shape[0])
    k, v = c["k"], c["v"]

    def attention(q):
        return mgpu.ragged_paged_attention_mgpu(
            q, k, v, s["q_start"], s["q_len"], s["ctx_len"], s["tables"], layer=jnp.int32(0), sm_scale=SCALE,
            packing=packing,
        )  # fmt: skip

    w = jax.random.normal(key, (2048, 11264), jnp.bfloat16) * 0.02
    h = jax.random.normal(key, (1024, 2048), jnp.bfloat16)

    def gate_up(x):
        return (x @ w)[:, :2048].astype(jnp.bfloat16)

    return gate_up, attention, h, c["q"]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gemm", type=int, default=8192, help="square GEMM size of the xla pair")
    ap.add_argument("--bw-gib", type=float, default=2.0, help="GiB the xla pair's elementwise pass reads")
    ap.add_argument("--calls", type=int, default=8, help="calls per chain (and twice that: per_call_s)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny xla pair only (CPU)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.smoke:
        a.gemm, a.bw_gib, a.calls, a.reps = 64, 1 / 1024, 2, 2
    out = dict(benchmark="stream_overlap", device=jax.devices()[0].device_kind, jax_version=jax.__version__, pairs={})
    first, second, a0, b0 = xla_pair(a.gemm, int(a.bw_gib * (1 << 30)) // 2)
    out["pairs"]["xla"] = dict(
        first=f"bf16 GEMM {a.gemm}^3", second=f"elementwise over {a.bw_gib} GiB",
        **measure_pair(first, second, a0, b0, a.calls, a.reps),
    )  # fmt: skip
    if not a.smoke and jax.default_backend() == "gpu":
        first, second, a0, b0 = engine_pair(jax.random.key(0))
        out["pairs"]["engine"] = dict(
            first="gate/up GEMM 1024 x 2048 x 11264", second="Mosaic attention 16 x 64 rows at 4K",
            **measure_pair(first, second, a0, b0, a.calls, a.reps),
        )  # fmt: skip
    for name, rec in out["pairs"].items():
        figures = ", ".join(f"{k} {v:.3f}" for k, v in rec.items() if isinstance(v, float))
        print(f"{name}: {figures}" + (f"; errors {rec['errors']}" if rec.get("errors") else ""), flush=True)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
