"""``x @ w`` for a few decode rows on Hopper, computed transposed with ``x`` resident (Pallas,
Mosaic GPU): issue 36's next decode GEMM, measured by ``benchmarks/decode_gemm.py`` (``mgpu_t``)
before any engine wiring.

One launch can read a decode layer's weights at the copy's bandwidth
(``benchmarks/weight_stream.py``); ``decode_gemm_mgpu`` and ``decode_mlp_mgpu`` do not, and in
that benchmark shallow rings and a refill after each step's wgmma are what cost time
(docs/roadmap.md, "Run 44", has the figures). This kernel has neither:

* ``y^T = w^T x^T``: a weight tile ``[block_k, block_n]``, read through a transposed view, is
  wgmma's 64-row A operand (16-bit types allow a transposed A) and the ``R`` rows of ``x`` (8 or
  16) its N operand, so no shared memory or tensor-core work goes to rows padded up to 64 (the
  skinny GEMM of c47db58 had the same product).
* ``x``'s slices of the CTA's K range are copied once, at the start, each on its own barrier, and
  stay: the ring holds weight tiles only, ``stages`` of them (Ouro-1.4B at 8 rows: 8 for
  Q/K/V and down, 4 for O's 4-step splits and for gate/up, whose 176 CTAs share SMs two by two).
* The refill runs one wgmma behind: step ``i`` issues its wgmma, waits for step ``i - 1``'s
  (``wgmma_wait(1)``) and refills that slot, so the tensor cores never hold a slot the TMA
  engine could be filling.
* One CTA = (a column block of ``block_n`` = 64 columns, a K split); splits bring the grid to
  about one CTA an SM. Each CTA stores its f32 partial ``y^T`` block into ``[splits, N, R]``; the
  wrapper hands back ``[splits, M, N]`` (a transposed view that XLA fuses, with the split sum,
  into the consumer) or the sum. That transpose-and-sum is what the skinny GEMM lost to in the
  engine (docs/decisions.md, "Mosaic GPU paths for small decode buckets"): measure the consumer's
  fusion too.

K and N must be multiples of 64 (whole swizzle atoms of the TMA tiles). :func:`decode_gemm_t_reference`
is the jnp twin: the same split decomposition, exact f32 sums of products (``decode_gemm_mgpu``'s
``split_products``); it also takes float32. The CPU tests cross-lower the kernel for CUDA and run
it in Pallas' GPU interpreter with wgmma stood in for; the GPU tests compare kernel and twin.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.decode_gemm_mgpu import (
    BLOCK_N,
    MAX_ROWS,
    MAX_STAGES,
    NUM_SMS,
    ROW_GROUP,
    SMEM_LIMIT,
    cdiv,
    check_knobs,
    check_operands,
    split_k,
    split_products,
    swizzled,
)

SMEM_TWO_CTAS = 112 * 1024  # per CTA, so that two fit an SM (228 KB, 1 KB reserved per CTA)

__all__ = ["TTuning", "decode_gemm_t_mgpu", "decode_gemm_t_reference", "supported", "t_tuning"]


@dataclasses.dataclass(frozen=True)
class TTuning:
    """Static knobs of one launch (``t_tuning`` checks and normalises them)."""

    block_k: int  # K per pipeline step (a multiple of 64)
    splits: int  # K ranges (grid dimension), none empty
    steps_per_split: int
    stages: int  # weight tiles in flight (>= 2 where a split has 2 steps or more)
    rows: int  # R: the rows of x the launch works on (8 or 16)

    def smem_bytes(self, itemsize: int = 2) -> int:
        """The weight ring, x's resident slices and the f32 output staging."""
        ring = self.stages * self.block_k * BLOCK_N * itemsize
        x = self.steps_per_split * self.rows * self.block_k * itemsize
        return ring + x + BLOCK_N * self.rows * 4


def t_tuning(
    m: int,
    k: int,
    n: int,
    itemsize: int = 2,
    *,
    block_k: int | None = None,
    splits: int | None = None,
    stages: int | None = None,
) -> TTuning:
    """Defaults for ``[m, k] @ [k, n]``; a knob given overrides its default (checked:
    ``ValueError``). ``block_k``: 128 (a 16 KB weight tile). ``splits``: enough K ranges that the
    ``n / 64`` column blocks reach one CTA an SM, normalised so that none is empty. ``stages``: as
    many weight tiles as fit with x's slices (in half an SM's shared memory where the CTAs
    outnumber the SMs), at most ``MAX_STAGES``, cut to a split's steps."""
    block_k = 128 if block_k is None else block_k
    check_knobs(block_k)
    rows = cdiv(m, ROW_GROUP) * ROW_GROUP
    splits, per_split = split_k(cdiv(k, block_k), n // BLOCK_N, splits, NUM_SMS)
    fixed = per_split * rows * block_k * itemsize + BLOCK_N * rows * 4
    tile = block_k * BLOCK_N * itemsize
    if stages is None:
        # more column blocks than SMs (gate/up: 176): two CTAs an SM, so that all are resident
        budget = SMEM_TWO_CTAS if (n // BLOCK_N) * splits > NUM_SMS else SMEM_LIMIT
        stages = max(2, min(MAX_STAGES, (budget - fixed) // tile))
    if stages < 2 and per_split > 1:
        raise ValueError(f"stages={stages} must be >= 2 (the refill runs one wgmma behind)")
    t = TTuning(int(block_k), int(splits), int(per_split), int(min(stages, per_split)), int(rows))
    if t.smem_bytes(itemsize) > SMEM_LIMIT:
        raise ValueError(f"stages={stages} with block_k={block_k} need {t.smem_bytes(itemsize)} B > {SMEM_LIMIT}")
    return t


def supported(dtype, m: int, k: int, n: int) -> str | None:
    """Why the kernel cannot serve ``[m, k] @ [k, n]`` in ``dtype`` (``None`` when it can)."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name} (needs bfloat16 or float16)"
    if not 1 <= m <= MAX_ROWS:
        return f"{m} rows (needs 1..{MAX_ROWS})"
    for name, v in (("K", k), ("N", n)):
        if v < 64 or v % 64:
            return f"{name}={v} (needs a multiple of 64: the TMA tiles are whole swizzle atoms)"
    return None


def _kernel(x_ref, w_ref, o_ref, x_smem, w_smem, o_smem, x_ready, ready, *, t: TTuning, k_steps: int):
    """One CTA: the f32 partial ``y^T[n0:n0+64, :]`` of its K range."""
    bk, stages, sps = t.block_k, t.stages, t.steps_per_split
    n0 = lax.axis_index("n") * BLOCK_N
    sp = lax.axis_index("split")
    step0 = sp * sps
    n_steps = jnp.minimum(sps, k_steps - step0)  # >= 1: the tuning leaves no split empty

    def issue(i, slot):
        k0 = (step0 + i) * bk
        plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(k0, bk), pl.ds(n0, BLOCK_N)], w_smem.at[slot], ready.at[slot])

    for i in range(stages):

        @pl.when(i < n_steps)
        def _():
            issue(jnp.int32(i), i)

    for i in range(sps):  # x's slices: copied once, kept

        @pl.when(i < n_steps)
        def _():
            k0 = (step0 + i) * bk
            plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds(k0, bk)], x_smem.at[i], x_ready.at[i])

    def acc_scope(acc_ref):
        @pl.loop(0, n_steps)
        def _(i):
            slot = lax.rem(i, jnp.int32(stages))
            plgpu.barrier_wait(x_ready.at[i])
            plgpu.barrier_wait(ready.at[slot])
            plgpu.wgmma(acc_ref, w_smem.at[slot].transpose((1, 0)), x_smem.at[i].transpose((1, 0)))
            plgpu.wgmma_wait(1)  # step i - 1's wgmma is done: its slot takes the tile `stages` ahead

            @pl.when((i > 0) & (i - 1 + stages < n_steps))
            def _():
                issue(i - 1 + stages, lax.rem(i - 1, jnp.int32(stages)))

        plgpu.wgmma_wait(0)
        return acc_ref[...]

    o_smem[...] = pl.run_scoped(acc_scope, plgpu.ACC((BLOCK_N, t.rows), jnp.float32))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[sp, pl.ds(n0, BLOCK_N)])
    plgpu.wait_smem_to_gmem(0)


def _call(x, w, t: TTuning):
    """The launch: ``x [R, K] @ w [K, N]`` -> the f32 partials ``[splits, N, R]`` (transposed)."""
    k, n = w.shape
    dt = x.dtype
    tiles = swizzled(BLOCK_N, dt.itemsize)  # 128-byte rows: the weight tiles and x's slices
    out_tiles = swizzled(t.rows, 4)  # f32 rows of R: 32- or 64-byte swizzles

    def entry(x_ref, w_ref, o_ref):
        pl.run_scoped(
            functools.partial(_kernel, x_ref, w_ref, o_ref, t=t, k_steps=cdiv(k, t.block_k)),
            plgpu.SMEM((t.steps_per_split, t.rows, t.block_k), dt, transforms=tiles),
            plgpu.SMEM((t.stages, t.block_k, BLOCK_N), dt, transforms=tiles),
            plgpu.SMEM((BLOCK_N, t.rows), jnp.float32, transforms=out_tiles),
            plgpu.Barrier(num_arrivals=1, num_barriers=t.steps_per_split),
            plgpu.Barrier(num_arrivals=1, num_barriers=t.stages),
        )

    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((t.splits, n, t.rows), jnp.float32),
        grid=(n // BLOCK_N, t.splits),
        grid_names=("n", "split"),
    )(x, w)


def _check(x, w, *, kernel: bool) -> tuple[int, int, int]:
    return check_operands(x, w, kernel=kernel, why_not=supported, name="decode_gemm_t_mgpu")


_STATIC = ("block_k", "splits", "stages", "reduce")


@functools.partial(jax.jit, static_argnames=_STATIC)
def decode_gemm_t_mgpu(x, w, *, block_k=None, splits=None, stages=None, reduce=True):
    """``x [M, K] @ w [K, *out]`` (module docstring). ``reduce=True``: ``[M, *out]`` in float32;
    ``reduce=False``: the f32 partials ``[splits, M, *out]`` of the K splits."""
    m, k, n = _check(x, w, kernel=True)
    t = t_tuning(m, k, n, x.dtype.itemsize, block_k=block_k, splits=splits, stages=stages)
    xr = x if t.rows == m else jnp.pad(x, ((0, t.rows - m), (0, 0)))
    part = jnp.swapaxes(_call(xr, w.reshape(k, n), t)[:, :, :m], 1, 2)  # [splits, M, N]
    part = part.reshape(t.splits, m, *w.shape[1:])
    return jnp.sum(part, axis=0) if reduce else part


@functools.partial(jax.jit, static_argnames=_STATIC)
def decode_gemm_t_reference(x, w, *, block_k=None, splits=None, stages=None, reduce=True):
    """jnp twin of :func:`decode_gemm_t_mgpu` (same arguments and outputs). Also takes float32."""
    m, k, n = _check(x, w, kernel=False)
    t = t_tuning(m, k, n, 2, block_k=block_k, splits=splits, stages=stages)
    part = split_products(x, w.reshape(k, n), t).reshape(t.splits, m, *w.shape[1:])
    return jnp.sum(part, axis=0) if reduce else part
