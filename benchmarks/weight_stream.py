"""How fast one Mosaic GPU launch can read a decode layer's weights (issue 36): the ceiling our
decode GEMM kernels are measured against.

A decode GEMM of a few rows is a read of its weights. This streams a ``[K, N]`` bf16 matrix (by
default Ouro-1.4B's MLP: gate/up ``[2048, 11264]`` and down's ``2048 x 5632`` as one ``[2048,
16896]``, 69 MB, past the L2) through a ring of ``stages`` shared-memory slots of ``[bk, 64]``
TMA tiles, per CTA, and does nothing else (``mode="stream"``) or one wgmma a tile with a zeroed
``[64, bk]`` A operand, as the decode kernels' padded rows (``mma_wait0``: a slot is refilled once
its wgmma is done, the decode kernels' loop; ``mma_wait1``: the previous slot is refilled once the
previous wgmma is done, one wgmma in flight). ``order``: ``rows``, each CTA a contiguous run of
the row-major tile order (balanced over the CTAs); ``bands``, each CTA whole 64-column bands over
all of K (a GEMM's natural split: a CTA owns its output columns). XLA's read-only reduce and a
scale-and-copy of the same matrix are the references.

Kernel device time by CUPTI (``benchmarks.timing.kernels_us``), the median of 20 calls; TB/s as
bytes read over it (the copy: bytes read and written).

    python -m benchmarks.weight_stream --out DIR            # the grid below -> DIR/weight_stream.json
    python -m benchmarks.weight_stream --ctas 88 128 --stages 4 8 --modes stream mma_wait1

Needs a Hopper GPU (CUPTI, TMA, wgmma); elsewhere it says so and writes nothing.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.decode_gemm_mgpu import A_ROWS, BLOCK_N, cdiv

__all__ = ["MODES", "ORDERS", "cases", "main", "stream"]

MODES = ("stream", "mma_wait0", "mma_wait1")
ORDERS = ("rows", "bands")
SMEM_BUDGET = 200 * 1024  # the ring and the A tile of one CTA
MLP_SHAPE = (2048, 16896)  # Ouro-1.4B: gate/up [2048, 11264] and down's 5632 x 2048, as one matrix


def stream(w, *, ctas: int, stages: int, bk: int, mode: str = "stream", order: str = "rows"):
    """One launch of ``ctas`` CTAs reading all of ``w [K, N]`` (module docstring); returns a
    ``[ctas, 8, 64]`` sample of what each CTA read or computed, so nothing is dead."""
    if mode not in MODES or order not in ORDERS:
        raise ValueError(f"mode must be one of {MODES} and order one of {ORDERS}, got {mode!r}, {order!r}")
    k, n = w.shape
    if k % bk or n % BLOCK_N:
        raise ValueError(f"w {w.shape}: K must be a multiple of bk={bk} and N of {BLOCK_N}")
    nk, nn = k // bk, n // BLOCK_N
    total = nk * nn
    tiles = (plgpu.TilingTransform((8, BLOCK_N)), plgpu.SwizzleTransform(2 * BLOCK_N))

    def body(w_ref, o_ref, ring, a_smem, o_smem, ready):
        c = lax.axis_index("c")
        if order == "rows":
            per = cdiv(total, ctas)
            count = jnp.clip(total - c * per, 0, per)

            def tile(i):
                t = c * per + i
                return lax.div(t, nn), lax.rem(t, nn)
        else:
            count = lax.div(nn - c + ctas - 1, ctas) * nk  # bands c, c + ctas, ...

            def tile(i):
                return lax.rem(i, nk), c + lax.div(i, nk) * ctas

        def issue(i, slot):
            kb, nb = tile(i)
            src = w_ref.at[pl.ds(kb * bk, bk), pl.ds(nb * BLOCK_N, BLOCK_N)]
            plgpu.copy_gmem_to_smem(src, ring.at[slot], ready.at[slot])

        a_smem[...] = jnp.zeros(a_smem.shape, a_smem.dtype)
        plgpu.commit_smem()
        for i in range(stages):

            @pl.when(i < count)
            def _():
                issue(jnp.int32(i), i)

        def acc_scope(acc):
            @pl.loop(0, count)
            def _(i):
                slot = lax.rem(i, jnp.int32(stages))
                plgpu.barrier_wait(ready.at[slot])
                if mode == "stream":

                    @pl.when(i + stages < count)
                    def _():
                        issue(i + stages, slot)

                    return
                plgpu.wgmma(acc, a_smem, ring.at[slot])
                if mode == "mma_wait0":
                    plgpu.wgmma_wait(0)

                    @pl.when(i + stages < count)
                    def _():
                        issue(i + stages, slot)

                else:
                    plgpu.wgmma_wait(1)  # step i - 1's wgmma is done: its slot is free

                    @pl.when((i > 0) & (i - 1 + stages < count))
                    def _():
                        issue(i - 1 + stages, lax.rem(i + stages - 1, jnp.int32(stages)))

            plgpu.wgmma_wait(0)
            return acc[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((A_ROWS, BLOCK_N), jnp.float32))
        if mode == "stream":
            sample = ring.at[0, pl.ds(0, 8)]  # what the last pass left in slot 0
        else:
            o_smem[...] = acc.astype(o_smem.dtype)
            plgpu.commit_smem()
            sample = o_smem.at[pl.ds(0, 8)]
        plgpu.copy_smem_to_gmem(sample, o_ref.at[c])
        plgpu.wait_smem_to_gmem(0)

    def entry(w_ref, o_ref):
        pl.run_scoped(
            functools.partial(body, w_ref, o_ref),
            plgpu.SMEM((stages, bk, BLOCK_N), w.dtype, transforms=tiles),
            plgpu.SMEM((A_ROWS, bk), w.dtype, transforms=tiles),
            plgpu.SMEM((A_ROWS, BLOCK_N), w.dtype, transforms=tiles),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        )

    out = jax.ShapeDtypeStruct((ctas, 8, BLOCK_N), w.dtype)
    return plgpu.kernel(entry, out_type=out, grid=(ctas,), grid_names=("c",))(w)


def cases(ctas, stages, bks, modes, orders) -> list[dict]:
    """The grid's launches whose ring and A tile fit ``SMEM_BUDGET`` (bf16)."""
    out = []
    for g, s, bk, m, o in itertools.product(ctas, stages, bks, modes, orders):
        if (s * bk * BLOCK_N + A_ROWS * bk) * 2 <= SMEM_BUDGET:
            out.append(dict(ctas=g, stages=s, bk=bk, mode=m, order=o))
    return out


def main(argv=None) -> dict | None:
    from pallas_kernels import dispatch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=int, nargs=2, default=list(MLP_SHAPE), metavar=("K", "N"))
    ap.add_argument("--ctas", type=int, nargs="*", default=[88, 128, 132])
    ap.add_argument("--stages", type=int, nargs="*", default=[2, 4, 8])
    ap.add_argument("--bk", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES))
    ap.add_argument("--orders", nargs="*", choices=ORDERS, default=list(ORDERS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    if not dispatch.hopper_available():
        print("weight_stream needs a Hopper GPU (TMA, wgmma, CUPTI): nothing measured")
        return None
    from benchmarks.timing import kernels_us

    w = jax.random.normal(jax.random.PRNGKey(0), tuple(a.shape), jnp.bfloat16)
    nbytes = w.size * w.dtype.itemsize
    refs = {
        "xla_reduce": (jax.jit(lambda w: jnp.sum(w.astype(jnp.float32), axis=0)), nbytes),
        "xla_scale_copy": (jax.jit(lambda w: w * 2), 2 * nbytes),
    }
    records = []
    for name, (fn, moved) in refs.items():
        us = sum(kernels_us(fn, w, iters=a.iters).values())
        records.append(dict(case=name, us=us, tbps=moved / us / 1e6))
        print(json.dumps(records[-1]), flush=True)
    for case in cases(a.ctas, a.stages, a.bk, a.modes, a.orders):
        rec = dict(case=case)
        try:
            us = sum(kernels_us(jax.jit(functools.partial(stream, **case)), w, iters=a.iters).values())
            rec.update(us=us, tbps=nbytes / us / 1e6)
        except Exception as e:  # noqa: BLE001 - a launch the GPU refuses is a record, not the end
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        records.append(rec)
        print(json.dumps(rec), flush=True)
    out = dict(benchmark="weight_stream", device=jax.devices()[0].device_kind, shape=a.shape, bytes=nbytes)
    out["records"] = records
    from benchmarks.run import save_json

    os.makedirs(a.out, exist_ok=True)
    save_json(out, os.path.join(a.out, "weight_stream.json"))
    return out


if __name__ == "__main__":
    main()
