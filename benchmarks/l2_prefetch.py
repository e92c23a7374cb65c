"""Does a weight prefetched into the L2 by the kernel before a decode GEMM make XLA's GEMM faster
(issue 36)? The probe before any engine wiring.

Between a decode layer's GEMMs run kernels that read little: at one row the attention reads ~8 MB
in ~7 us, the two norms and the K/V write ~2 us each. The memory is mostly idle there, while each
GEMM reads its weights at 47-77% of the bandwidth (docs/roadmap.md, "Where the time goes"). A TMA
prefetch (``cp.async.bulk.prefetch.tensor.L2``, ``plgpu.async_prefetch``) costs its issuing kernel
almost nothing and could bring the next GEMM's weights into the L2 (50 MB on an H100 or H200)
while that kernel runs.

For each weight of an Ouro-1.4B layer (``--shapes``), XLA's GEMM of ``--rows`` rows is timed after
a stand-in for the kernel before it: a Mosaic GPU kernel of ``--ctas`` CTAs that spins ``--spin``
iterations (the attention's time) and, in mode ``prefetch``, first issues L2 prefetches of the
first ``--fraction`` of the weight's ``[128, 128]`` boxes; mode ``cold`` spins without prefetching.
Both read a ``--flush-mb`` buffer first (past the L2). Mode ``warm`` has no flush: the weight is in
the L2 as the previous call's GEMM left it (the ceiling, for weights that fit). Kernel device time
by CUPTI (``benchmarks.timing.kernels_us``), median of ``--iters`` calls; ``gemm_us`` is the
kernels after the stand-in: the GEMM, any split-K reduce, and the add that orders the GEMM after
the stand-in where XLA does not fuse it (the same in every mode; ``kernels_us`` keeps each kernel).

    python -m benchmarks.l2_prefetch --out DIR          # -> DIR/l2_prefetch.json
    python -m benchmarks.l2_prefetch --shapes o=2048x2048 --spin 0 2000 --fraction 0.5 1

Needs a Hopper GPU (TMA, CUPTI); elsewhere it says so and writes nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.decode_gemm_mgpu import cdiv

__all__ = ["BOX", "MODES", "LAYER_SHAPES", "chain", "main", "spin_prefetch"]

BOX = (128, 128)  # one prefetch: 32 KB of bf16 (a TMA box dimension is at most 256)
MODES = ("cold", "prefetch", "warm")
# Ouro-1.4B's decode GEMM weights [K, N]: Q/K/V fused, O, gate/up fused, down
LAYER_SHAPES = {"qkv": (2048, 6144), "o": (2048, 2048), "gate_up": (2048, 11264), "down": (5632, 2048)}
_OUT = (8, 128)  # each CTA's sample of its spin result: keeps the loop live


def spin_prefetch(w, after, *, ctas: int, spin: int, fraction: float = 0.0):
    """One launch of ``ctas`` CTAs: L2 prefetches of the first ``fraction`` of ``w``'s ``BOX``
    boxes (row-major, spread evenly over the CTAs), then ``spin`` dependent float updates.
    ``after`` (any array) is an unused input that orders the launch after its producer. Returns
    ``[ctas, 8, 128]`` float32: the GEMM that follows takes it as an input, so it runs after."""
    k, n = w.shape
    if k % BOX[0] or n % BOX[1]:
        raise ValueError(f"w {w.shape}: both dimensions must be multiples of {BOX}")
    if not 0.0 <= fraction <= 1.0 or spin < 0 or ctas < 1:
        raise ValueError(f"need 0 <= fraction <= 1, spin >= 0, ctas >= 1; got {fraction}, {spin}, {ctas}")
    boxes_n = n // BOX[1]
    total = round(fraction * (k // BOX[0]) * boxes_n)
    per = cdiv(total, ctas) if total else 0

    def body(w_ref, after_ref, o_ref, o_smem):
        del after_ref
        c = lax.axis_index("c")
        if total:

            @pl.loop(0, jnp.clip(total - c * per, 0, per))
            def _(i):
                t = c * per + i
                kb, nb = lax.div(t, boxes_n), lax.rem(t, boxes_n)
                plgpu.async_prefetch(w_ref.at[pl.ds(kb * BOX[0], BOX[0]), pl.ds(nb * BOX[1], BOX[1])])

        v = lax.fori_loop(0, spin, lambda i, v: v * 0.999 + 1e-3, jnp.float32(1.0))
        o_smem[...] = jnp.full(_OUT, v, jnp.float32)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[c])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((ctas, *_OUT), jnp.float32),
        scratch_types=[plgpu.SMEM(_OUT, jnp.float32)],
        grid=(ctas,),
        grid_names=("c",),
    )(w, after)


def chain(x, w, flush, *, mode: str, ctas: int, spin: int, fraction: float):
    """flush (not in ``warm``) -> the stand-in (prefetching only in ``prefetch``) -> ``x @ w``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    after = jnp.zeros((1,), jnp.float32) if mode == "warm" else jnp.sum(flush).reshape(1)
    token = spin_prefetch(w, after, ctas=ctas, spin=spin, fraction=fraction if mode == "prefetch" else 0.0)
    x = x + (token[0, 0, 0] * 0).astype(x.dtype)  # the GEMM waits for the stand-in
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def _measure(a, name: str, x, w, flush, kernels_us) -> list[dict]:
    """The records of one weight: every spin, mode and (``prefetch``) fraction of ``a``."""
    (k, n), records = w.shape, []
    for spin, mode in itertools.product(a.spin, a.modes):
        for fraction in a.fraction if mode == "prefetch" else [None]:
            rec = dict(shape=name, k=k, n=n, rows=a.rows, mode=mode, spin=spin, fraction=fraction, ctas=a.ctas)
            try:
                fn = jax.jit(
                    lambda x, w, f: chain(x, w, f, mode=mode, ctas=a.ctas, spin=spin, fraction=fraction or 0.0)
                )
                us = kernels_us(fn, x, w, flush, iters=a.iters)
                names = list(us)  # launch order: [flush,] stand-in, GEMM kernels
                stand_in = next(i for i, s in enumerate(names) if "mosaic" in s)
                rec.update(
                    kernels_us=us,
                    stand_in_us=us[names[stand_in]],
                    gemm_us=sum(us[s] for s in names[stand_in + 1 :]),
                )
                rec["gemm_tbps"] = k * n * 2 / rec["gemm_us"] / 1e6
            except Exception as e:  # noqa: BLE001 - a launch the GPU refuses is a record, not the end
                rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            records.append(rec)
            print(json.dumps({x: v for x, v in rec.items() if x != "kernels_us"}), flush=True)
    return records


def _shape(text: str) -> tuple[str, tuple[int, int]]:
    name, _, dims = text.partition("=")
    k, _, n = dims.partition("x")
    if not (name and k.isdigit() and n.isdigit()):
        raise argparse.ArgumentTypeError(f"a shape is NAME=KxN, got {text!r}")
    return name, (int(k), int(n))


def main(argv=None) -> dict | None:
    from pallas_kernels import dispatch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", type=_shape, nargs="*", default=list(LAYER_SHAPES.items()), metavar="NAME=KxN")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--ctas", type=int, default=132)
    ap.add_argument("--spin", type=int, nargs="*", default=[2000])
    ap.add_argument("--fraction", type=float, nargs="*", default=[1.0])
    ap.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES))
    ap.add_argument("--flush-mb", type=int, default=256)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    if not dispatch.hopper_available():
        print("l2_prefetch needs a Hopper GPU (TMA, CUPTI): nothing measured")
        return None
    from benchmarks.run import save_json
    from benchmarks.timing import kernels_us

    flush = jnp.ones((a.flush_mb * 2**20 // 4,), jnp.float32)
    records = []
    for name, (k, n) in a.shapes:
        w = jax.random.normal(jax.random.PRNGKey(k + n), (k, n), jnp.bfloat16)
        x = jax.random.normal(jax.random.PRNGKey(1), (a.rows, k), jnp.bfloat16)
        records += _measure(a, name, x, w, flush, kernels_us)
    out = dict(benchmark="l2_prefetch", device=jax.devices()[0].device_kind, jax_version=jax.__version__)
    out.update(args={k: v for k, v in vars(a).items() if k != "out"}, records=records)
    os.makedirs(a.out, exist_ok=True)
    save_json(out, os.path.join(a.out, "l2_prefetch.json"))
    return out


if __name__ == "__main__":
    main()
