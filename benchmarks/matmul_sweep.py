"""Skinny matmul sweep on the GPU: the Mosaic GPU kernel (pallas_kernels/skinny_matmul_mgpu.py) vs
XLA's ``jnp.dot`` on the four Ouro-1.4B layer projections, for M = 1, 8, 16, 32, 64 rows.

Both sides: bf16 in, bf16 out (``reduce=True``: the kernel's split sum is an XLA fusion after it,
as XLA's own split-K GEMMs have their reduce kernels). Timing: jits holding ``n`` and ``2n``
calls cycling over ``n`` copies of the weight (>= 256 MB of copies, so no call finds its weight in
the 50 MB L2), each call on its own copy of ``x``; 2 warm-ups, median of ``reps`` runs each; the
time of a call is ``(t(2n) - t(n)) / n``, which cancels the jit's fixed launch cost (~0.2-0.3 ms on
the H200 host). Run 18 divided ``t(n)`` by ``n`` (11 calls for ``qkv``) and measured 20-80 us a call
for XLA and the kernel alike: launch overhead, not device time. Per case: us, GB/s of the bytes that must
move (weight + x + y), and ``fraction_of_floor`` = floor / time, the floor being those bytes over
4.8 TB/s (the H200's nominal HBM bandwidth; ``fraction_of_copy_floor`` uses the copy bandwidth
measured in the same run, ``benchmarks/ceilings.py``, which is what an ideal streaming kernel
reaches).

``--check``: first kernel vs ``jnp.dot`` (and vs its jnp twin's f32 partials) on every shape,
exit 1 on a mismatch. ``--tune``: also a small grid of knobs per case (``best_knobs``).
``--smoke``: CPU plumbing check, the jnp twin in the kernel's place on tiny shapes (no timing
meaning). Without a Hopper GPU and without ``--smoke`` it exits 2 saying so.

Usage: PYTHONPATH=. python benchmarks/matmul_sweep.py [--check] [--tune] [--rows 1,8,16,32,64]
       [--shapes qkv,o,gate_up,down] [--reps 7] [--out DIR] [--no-copy]
Writes DIR/matmul_sweep.json (and .png), also copied to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks import ceilings as ceilings_mod  # noqa: E402
from benchmarks.timing import per_call_s  # noqa: E402
from pallas_kernels import skinny_matmul_mgpu as sk  # noqa: E402

NOMINAL_BW = 4.8e12  # H200 HBM3e, bytes/s
L2_DEFEAT_BYTES = 256 << 20
DT = jnp.bfloat16
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# Ouro-1.4B per layer: K and the stored kernel's output shape
SHAPES = {
    "qkv": (2048, (16, 3, 128)),
    "o": (2048, (2048,)),
    "gate_up": (2048, (2, 5632)),
    "down": (5632, (2048,)),
}
ROWS = (1, 8, 16, 32, 64)
# --tune grid: (block_n, block_k, splits, stages); None = the default for that knob
KNOBS = [
    (64, 128, None, None),
    (128, 64, None, None),
    (128, 128, None, None),
    (256, 64, None, None),
    (128, 64, None, 4),
    (64, 128, None, 4),
]
SMOKE_SHAPES = {"a": (128, (128,)), "b": (256, (2, 64))}


def log(*a):
    print(*a, flush=True)


def nbytes(m, k, n):
    return 2 * (k * n + m * k + m * n)


def timeit(f, xs, ws, reps):
    """us per call of ``f`` over the weight copies ``ws`` and the ``2 len(ws)`` inputs ``xs``
    (``benchmarks.timing.per_call_s``: the jit's launch cancelled)."""
    return per_call_s(lambda n: many(f, n), (xs, ws), len(ws), reps) * 1e6


def _args(m, k, out, seed=0):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(DT)
    w = (jax.random.normal(kw, (k, *out), jnp.float32) / np.sqrt(k)).astype(DT)
    return x, w


def xla_dot(x, w):
    k = x.shape[1]
    return jnp.dot(x, w.reshape(k, -1)).reshape(x.shape[0], *w.shape[1:])


def kernel_fn(smoke: bool):
    return sk.skinny_matmul_reference if smoke else sk.skinny_matmul_mgpu


def many(f, n_calls):
    """One jit of ``n_calls`` calls, call ``i`` on ``xs[i]`` and weight copy ``i % len(ws)``: every
    call has its own inputs (XLA would merge identical calls), and the jit returns the sum of the
    outputs' first elements: one scalar, not ``n_calls`` arrays, and no call is dead code."""

    @jax.jit
    def g(xs, ws):
        acc = jnp.zeros((), jnp.float32)
        for i in range(n_calls):
            acc = acc + f(xs[i], ws[i % len(ws)]).reshape(-1)[0].astype(jnp.float32)
        return acc

    return g


def distinct_inputs(x, n_calls):
    """``n_calls`` different copies of ``x`` (a few MB for these row counts), made outside timing."""
    return [(x * (1 + 2.0 ** (-6 - i % 5)) + i * 2.0**-10).astype(x.dtype) for i in range(n_calls)]


def check(shapes, rows, smoke: bool) -> list[str]:
    """Kernel vs jnp.dot (bf16 out) and vs the twin's f32 partials; the failures' descriptions."""
    bad = []
    f = kernel_fn(smoke)
    for name, (k, out) in shapes.items():
        for m in rows:
            x, w = _args(m, k, out, seed=m)
            want = np.asarray(
                jnp.dot(x.astype(jnp.float32), w.reshape(k, -1).astype(jnp.float32), precision="highest")
            ).reshape(m, *out)
            got = np.asarray(f(x, w), np.float32)
            xla = np.asarray(jax.jit(xla_dot)(x, w), np.float32)
            part = np.asarray(f(x, w, reduce=False))
            twin = np.asarray(sk.skinny_matmul_reference(x, w, reduce=False))
            errs = dict(
                vs_f32=float(np.max(np.abs(got - want))),
                vs_xla=float(np.max(np.abs(got - xla))),
                partials_vs_twin=float(np.max(np.abs(part - twin))) if part.shape == twin.shape else float("inf"),
            )
            ok = (
                np.allclose(got, want, rtol=1e-2, atol=2e-2)
                and np.allclose(got, xla, rtol=1e-2, atol=2e-2)
                and part.shape == twin.shape
                and np.allclose(part, twin, rtol=1e-4, atol=1e-4)
            )
            log(f"check {name} M={m}: {'ok' if ok else 'MISMATCH'} {errs}")
            if not ok:
                bad.append(f"{name} M={m}: {errs}")
    return bad


def run_case(name, k, out, m, *, reps, tune, bw_copy, smoke):
    n = int(np.prod(out))
    w_bytes = 2 * k * n
    n_calls = 2 if smoke else max(2, -(-L2_DEFEAT_BYTES // w_bytes))
    x, w = _args(m, k, out)
    # separate buffers (a slice of one stacked array would be copied before the custom call)
    ws = [w] + [(w * (1 + 2.0 ** (-7 - i % 4))).astype(DT) for i in range(1, n_calls)]
    moved = nbytes(m, k, n)
    floor_us = moved / NOMINAL_BW * 1e6
    rec = dict(
        shape=name,
        m=m,
        k=k,
        n=n,
        bytes=moved,
        n_calls=n_calls,
        floor_us=floor_us,
        copy_floor_us=moved / bw_copy * 1e6 if bw_copy else None,
    )
    xs = distinct_inputs(x, 2 * n_calls)
    rec["xla_us"] = timeit(xla_dot, xs, ws, reps)
    f = kernel_fn(smoke)
    t = sk.skinny_tuning(m, k, n)
    rec["default_knobs"] = dict(block_n=t.block_n, block_k=t.block_k, splits=t.splits, stages=t.stages)
    rec["mgpu_us"] = timeit(f, xs, ws, reps)
    best = (rec["mgpu_us"], rec["default_knobs"])
    if tune:
        rec["variants"] = []
        for bn, bk, splits, stages in KNOBS:
            knobs = dict(block_n=bn, block_k=bk, splits=splits, stages=stages)
            try:
                tk = sk.skinny_tuning(m, k, n, **knobs)
            except ValueError:
                continue
            eff = dict(block_n=tk.block_n, block_k=tk.block_k, splits=tk.splits, stages=tk.stages)
            if eff == rec["default_knobs"]:
                continue
            try:
                us = timeit(lambda a, b, kn=knobs: f(a, b, **kn), xs, ws, reps)
            except Exception as e:  # noqa: BLE001
                rec["variants"].append(dict(knobs=eff, error=str(e)[:200]))
                continue
            rec["variants"].append(dict(knobs=eff, us=us))
            if us < best[0]:
                best = (us, eff)
    rec["best_us"], rec["best_knobs"] = best
    for key in ("xla", "mgpu", "best"):
        us = rec[f"{key}_us"]
        rec[f"{key}_gbps"] = moved / us / 1e3
        rec[f"{key}_fraction_of_floor"] = floor_us / us
        if rec["copy_floor_us"]:
            rec[f"{key}_fraction_of_copy_floor"] = rec["copy_floor_us"] / us
    rec["speedup_vs_xla"] = rec["xla_us"] / rec["mgpu_us"]
    return rec


def plot(records, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        log(f"no plot: {e}")
        return
    names = sorted({r["shape"] for r in records})
    fig, axes = plt.subplots(1, max(1, len(names)), figsize=(4.5 * max(1, len(names)), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        rs = sorted((r for r in records if r["shape"] == name), key=lambda r: r["m"])
        ms = [r["m"] for r in rs]
        for key, style in (("xla", "x--"), ("mgpu", "o-"), ("best", ".:")):
            ax.plot(ms, [r[f"{key}_fraction_of_floor"] for r in rs], style, label=key)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{name}: K={rs[0]['k']}, N={rs[0]['n']}")
        ax.set_xlabel("rows M")
        ax.set_ylabel("fraction of the 4.8 TB/s floor")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(records):
    lines = [f"{'shape':8} {'M':>3} {'xla us':>8} {'mgpu us':>8} {'best us':>8} {'GB/s':>6} {'floor%':>6}  best knobs"]
    for r in records:
        lines.append(
            f"{r['shape']:8} {r['m']:>3} {r['xla_us']:8.2f} {r['mgpu_us']:8.2f} {r['best_us']:8.2f} "
            f"{r['best_gbps']:6.0f} {100 * r['best_fraction_of_floor']:6.1f}  {r['best_knobs']}"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda s: tuple(int(v) for v in s.split(",") if v.strip())  # noqa: E731
    ap.add_argument("--rows", type=ints, default=ROWS)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--check", action="store_true", help="verify kernel vs jnp.dot on every shape first")
    ap.add_argument("--check-only", action="store_true", help="only the check")
    ap.add_argument("--tune", action="store_true", help="also time a small grid of knobs")
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check: the jnp twin, tiny shapes")
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--no-copy", action="store_true", help="do not copy to benchmarks/results")
    args = ap.parse_args(argv)
    from pallas_kernels.dispatch import hopper_available

    if not args.smoke and not hopper_available():
        log(f"matmul_sweep needs a Hopper GPU (backend {jax.default_backend()}); --smoke runs the CPU plumbing check")
        return 2
    if args.smoke:
        shapes, args.no_copy = SMOKE_SHAPES, True
    else:
        shapes = {}
        for s in args.shapes.split(","):
            if s not in SHAPES:
                raise SystemExit(f"unknown shape {s!r}; known: {sorted(SHAPES)}")
            shapes[s] = SHAPES[s]
    bad_rows = [m for m in args.rows if not 1 <= m <= sk.MAX_ROWS]
    if bad_rows:
        raise SystemExit(f"rows must be in 1..{sk.MAX_ROWS}, got {bad_rows}")
    dev = jax.devices()[0]
    log(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    t_start = time.time()
    if args.check or args.check_only:
        bad = check(shapes, args.rows, args.smoke)
        if bad:
            log("MISMATCH:\n  " + "\n  ".join(bad))
            return 1
        log(f"check passed ({len(shapes) * len(args.rows)} cases, {time.time() - t_start:.0f} s)")
        if args.check_only:
            return 0
    bw_copy = None if args.smoke else ceilings_mod.copy_bandwidth()
    log(f"copy bandwidth: {bw_copy and bw_copy / 1e12:.3} TB/s" if bw_copy else "copy bandwidth: not measured")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "matmul_sweep.json")
    records = []

    def dump(final):
        with open(path, "w") as fh:
            json.dump(
                dict(
                    device=dev.device_kind,
                    backend=jax.default_backend(),
                    jax_version=jax.__version__,
                    smoke=args.smoke,
                    nominal_bandwidth=NOMINAL_BW,
                    copy_bandwidth=bw_copy,
                    complete=final,
                    wall_s=time.time() - t_start,
                    records=records,
                ),
                fh,
                indent=1,
            )

    for name, (k, out) in shapes.items():
        for m in args.rows:
            t0 = time.time()
            try:
                rec = run_case(name, k, out, m, reps=args.reps, tune=args.tune, bw_copy=bw_copy, smoke=args.smoke)
            except Exception as e:  # noqa: BLE001
                log(f"{name} M={m} FAILED: {type(e).__name__}: {str(e)[:500]}")
                traceback.print_exc()
                records.append(dict(shape=name, m=m, error=str(e)[:500]))
                dump(False)
                continue
            rec["device"] = dev.device_kind
            records.append(rec)
            log(
                f"{name} M={m}: xla {rec['xla_us']:.2f} us ({100 * rec['xla_fraction_of_floor']:.0f}%), "
                f"mgpu {rec['mgpu_us']:.2f} us ({100 * rec['mgpu_fraction_of_floor']:.0f}%), best "
                f"{rec['best_us']:.2f} us {rec['best_knobs']} ({time.time() - t0:.1f} s)"
            )
            dump(False)  # partial results survive a time limit
    dump(True)
    ok = [r for r in records if "error" not in r]
    plot(ok, os.path.join(args.out, "matmul_sweep.png"))
    if not args.no_copy and os.path.abspath(args.out) != os.path.abspath(RESULTS_DIR):
        os.makedirs(RESULTS_DIR, exist_ok=True)
        for name in ("matmul_sweep.json", "matmul_sweep.png"):
            if os.path.exists(os.path.join(args.out, name)):
                shutil.copy(os.path.join(args.out, name), os.path.join(RESULTS_DIR, name))
    log(table(ok))
    log(f"wrote {path} in {time.time() - t_start:.0f} s")
    return 0 if len(ok) == len(records) else 1


if __name__ == "__main__":
    sys.exit(main())
