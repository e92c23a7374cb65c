"""``x @ w`` for a few rows of ``x`` on Hopper (Pallas, Mosaic GPU): the decode projections.

With M = 1..16 rows the work of ``x [M, K] @ w [K, N]`` is reading ``w`` once: the kernel is
written to stream the weight at HBM bandwidth, compute is an afterthought.

* The product is computed transposed, ``y^T = w^T x^T``: a weight tile ``[block_k, block_n]`` in
  shared memory, read through a transposed view, is wgmma's 64-row A operand (16-bit types allow
  a transposed A), and the ``m_pad`` rows of ``x`` (8, 16, 32 or 64) are its narrow N operand. No
  tensor-core work or shared memory is spent on padding rows up to 64.
* One CTA = (N block of ``block_n`` columns, K split). A split owns ``steps_per_split`` whole
  ``block_k`` steps (the last split may own fewer; none is empty), so the grid is
  ``ceil(N / block_n) x splits`` CTAs: the defaults aim at ~2 CTAs per SM of an H200 (264).
* One warpgroup per CTA runs a ring of ``stages`` shared-memory slots: each step is two TMA copies
  (the weight tile and the matching ``[m_pad, block_k]`` slice of ``x``, re-read from L2 by every
  N block) on one barrier; it waits for the slot, issues the wgmma into a ``[block_n, m_pad]`` f32
  accumulator, waits for it and refills the slot with the step ``stages`` ahead. ``stages``
  tiles of the weight are always in flight.
* Each CTA stores its f32 partial ``y^T`` block (``[splits, N, m_pad]``); the wrapper hands back
  ``[splits, M, N]`` (a transposed view: XLA fuses it, and the split sum, into the consumer) or,
  with ``reduce=True``, the sum in the requested dtype.

Edges: K and N need not be multiples of the blocks. TMA fills the out-of-bounds part of a tile
with zeros (a K tail contributes ``0 * 0``) and drops out-of-bounds stores (an N tail). TMA needs
16-byte aligned rows, hence ``K % 8 == 0`` and ``N % 8 == 0`` for 16-bit types; ``x`` is padded to
``m_pad`` rows in the wrapper when ``M`` is not a power of two >= 8 (the engine's buckets of 8 and
16 rows never are).

:func:`skinny_matmul_reference` is the jnp twin: the same split decomposition (f32 partials of
the same K ranges), so the CPU tests check the tiling; it also takes float32. There is no CPU
interpret mode for the kernel (Pallas' GPU interpreter does not model wgmma); the CPU tests
cross-lower it for CUDA instead.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

MAX_ROWS = 64  # x rows one launch serves (the accumulator's N: 8..64, a power of two)
NUM_SMS = 132  # an H200
TARGET_CTAS = 2 * NUM_SMS  # two CTAs per SM: every weight tile of the launch in flight at once
MAX_SPLITS = 16
MAX_STAGES = 8
TILE_BYTES = 16 * 1024  # default weight tile per pipeline step
SMEM_TWO_CTAS = 112 * 1024  # per CTA, so that two fit an SM (228 KB, 1 KB reserved per CTA)
SMEM_LIMIT = 227 * 1024 - 512  # per CTA on Hopper, less the barriers
SWIZZLE = 128  # bytes; tiles of (8, 64) 16-bit elements


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


def padded_rows(m: int) -> int:
    """Rows of ``x`` the kernel works on: the next power of two >= 8 (the wgmma N and the f32
    output staging's swizzle, ``m_pad * 4`` bytes, must be one of 32 / 64 / 128 / 256)."""
    p = 8
    while p < m:
        p *= 2
    return p


def supported(dtype, m: int, k: int, n: int) -> str | None:
    """Why this kernel cannot serve ``[m, k] @ [k, n]`` in ``dtype`` (``None`` when it can)."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name} (needs bfloat16 or float16)"
    if not 1 <= m <= MAX_ROWS:
        return f"{m} rows (needs 1..{MAX_ROWS})"
    if k < 64 or k % 64:
        return f"K={k} (needs a multiple of 64: the minor dim of x's tiled TMA copies)"
    if n < 64 or n % 64:
        return f"N={n} (needs a multiple of 64: the minor dim of w's tiled TMA copies)"
    return None


TUNING_ENV = "OURO_JAX_SKINNY_TUNING"
_KNOBS = ("block_n", "block_k", "splits", "stages")


def tuning_overrides(text: str | None = None) -> dict:
    """``$OURO_JAX_SKINNY_TUNING`` (or ``text``) parsed: knobs of :func:`skinny_tuning` for the
    engine's projections, for A/B runs on the device. Entries split by ``;``, each
    ``[KxN:]knob=value,knob=value`` (``KxN`` limits it to that weight shape, else it applies to
    every projection; a shape's own entry wins over the global one knob by knob), e.g.
    ``2048x6144:block_n=64,splits=1;splits=4``. Returns ``{(K, N) or None: {knob: value}}``;
    ``ValueError`` names the variable and the entry it cannot read."""
    text = os.environ.get(TUNING_ENV, "") if text is None else text
    out: dict = {}
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        shape, sep, knobs = entry.rpartition(":")
        try:
            key = tuple(int(d) for d in shape.lower().split("x")) if sep else None
            if key is not None and len(key) != 2:
                raise ValueError(shape)
            kw = {}
            for item in knobs.split(","):
                name, eq, value = (x.strip() for x in item.partition("="))
                if not eq or name not in _KNOBS:
                    raise ValueError(item)
                kw[name] = int(value)
        except ValueError as e:
            raise ValueError(
                f"{TUNING_ENV}: cannot read {entry!r} ({e}); entries are '[KxN:]knob=value,...' with knobs {_KNOBS}"
            ) from None
        out.setdefault(key, {}).update(kw)
    return out


def knobs_for(k: int, n: int, overrides: dict | None = None) -> dict:
    """The override knobs of a ``[K, N]`` weight: the global entry updated by the shape's own."""
    overrides = tuning_overrides() if overrides is None else overrides
    return {**overrides.get(None, {}), **overrides.get((k, n), {})}


@dataclasses.dataclass(frozen=True)
class SkinnyTuning:
    """Static knobs of one launch, normalised: ``splits`` is the number of non-empty K splits."""

    block_n: int  # weight columns per CTA (a multiple of 64: wgmma's M)
    block_k: int  # K per pipeline step (a multiple of 64: one 128-byte swizzle atom)
    splits: int  # K splits (grid dimension), each ``steps_per_split`` steps (the last maybe fewer)
    stages: int  # pipeline slots (weight tiles in flight per CTA)
    steps_per_split: int
    m_pad: int

    def grid(self, n: int) -> tuple[int, int]:
        return _cdiv(n, self.block_n), self.splits


def smem_bytes(m_pad: int, block_n: int, block_k: int, stages: int, itemsize: int = 2) -> int:
    """Shared memory of one CTA: the ring (weight + x tiles) and the f32 output staging."""
    return stages * (block_k * block_n + m_pad * block_k) * itemsize + block_n * m_pad * 4


def skinny_tuning(
    m: int,
    k: int,
    n: int,
    itemsize: int = 2,
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    splits: int | None = None,
    stages: int | None = None,
    target_ctas: int = TARGET_CTAS,
) -> SkinnyTuning:
    """Defaults for ``[m, k] @ [k, n]``; any knob given overrides its default.

    ``block_n``: 128 when that still gives >= 32 N blocks (N >= ~4K), else 64 (the N = 2048
    projections need K splits either way). ``block_k``: a 16 KB weight tile per step.
    ``splits``: enough that N blocks x splits reach ``target_ctas`` (at most ``MAX_SPLITS`` and
    the number of K steps); then normalised so that no split is empty. ``stages``: as many slots
    as fit two CTAs per SM; any value is cut to the steps of a split. Every given knob is checked
    (ValueError).
    """
    m_pad = padded_rows(m)
    if block_n is None:
        block_n = 128 if _cdiv(n, 128) >= 32 else 64
        block_n = min(block_n, max(64, n // 64 * 64))
    if block_k is None:
        block_k = max(64, TILE_BYTES // (block_n * itemsize) // 64 * 64)
        block_k = min(block_k, _round_up(k, 64))
    if block_n < 64 or block_n % 64 or block_n > 256:
        raise ValueError(f"block_n={block_n} must be a multiple of 64 in 64..256 (wgmma's M rows of the tile)")
    if block_n > n:
        raise ValueError(f"block_n={block_n} must be <= N={n}")
    if block_k < 64 or block_k % 64:
        raise ValueError(f"block_k={block_k} must be a positive multiple of 64 (128-byte swizzle atoms)")
    k_steps = _cdiv(k, block_k)
    n_blocks = _cdiv(n, block_n)
    if splits is None:
        splits = min(MAX_SPLITS, k_steps, max(1, target_ctas // n_blocks))
    if splits < 1:
        raise ValueError(f"splits={splits} must be >= 1")
    splits = min(splits, k_steps)
    steps_per_split = _cdiv(k_steps, splits)
    splits = _cdiv(k_steps, steps_per_split)
    if stages is None:
        per_stage = (block_k * block_n + m_pad * block_k) * itemsize
        fit = (SMEM_TWO_CTAS - block_n * m_pad * 4) // per_stage
        stages = max(2, min(MAX_STAGES, fit))
    if stages < 1:
        raise ValueError(f"stages={stages} must be >= 1")
    stages = min(stages, steps_per_split)  # more slots than a split's steps would stay empty
    need = smem_bytes(m_pad, block_n, block_k, stages, itemsize)
    if need > SMEM_LIMIT:
        raise ValueError(
            f"block_n={block_n} x block_k={block_k} x {stages} stages need {need} B of shared memory > {SMEM_LIMIT}"
        )
    return SkinnyTuning(int(block_n), int(block_k), int(splits), int(stages), int(steps_per_split), int(m_pad))


def _check(x, w, *, kernel: bool):
    if x.ndim != 2 or w.ndim < 2:
        raise ValueError(f"x must be [M, K] and w [K, *out], got {x.shape} and {w.shape}")
    m, k = x.shape
    if w.shape[0] != k:
        raise ValueError(f"x {x.shape} and w {w.shape} disagree on K")
    if x.dtype != w.dtype:
        raise ValueError(f"x and w must share a dtype, got {x.dtype} and {w.dtype}")
    n = 1
    for d in w.shape[1:]:
        n *= d
    why = supported(x.dtype if kernel else jnp.bfloat16, m, k, n)
    if why is not None:
        raise ValueError(f"skinny_matmul_mgpu cannot serve {why}")
    return m, k, n


def _finish(part_t, m: int, out_shape: tuple, dtype, reduce: bool):
    """``[splits, N, m_pad]`` f32 partials -> ``[splits, M, *out]`` (or their sum in ``dtype``)."""
    part = jnp.swapaxes(part_t[:, :, :m], 1, 2)
    if reduce:
        return jnp.sum(part, axis=0).astype(dtype).reshape(m, *out_shape)
    return part.reshape(part.shape[0], m, *out_shape)


def _kernel(x_ref, w_ref, o_ref, x_smem, w_smem, o_smem, ready, *, t: SkinnyTuning, k_steps: int):
    bn, bk, stages, sps = t.block_n, t.block_k, t.stages, t.steps_per_split
    nb = lax.axis_index("n")
    sp = lax.axis_index("split")
    n0 = nb * bn
    step0 = sp * sps
    n_steps = jnp.minimum(sps, k_steps - step0)  # >= 1: the tuning leaves no split empty

    def issue(i, slot):
        k0 = (step0 + i) * bk
        plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(k0, bk), pl.ds(n0, bn)], w_smem.at[slot], ready.at[slot])
        plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds(k0, bk)], x_smem.at[slot], ready.at[slot])

    for i in range(stages):

        @pl.when(i < n_steps)
        def _():
            issue(jnp.int32(i), i)

    def acc_scope(acc_ref):
        @pl.loop(0, n_steps)
        def _(i):
            slot = lax.rem(i, jnp.int32(stages))
            plgpu.barrier_wait(ready.at[slot])
            plgpu.wgmma(acc_ref, w_smem.at[slot].transpose((1, 0)), x_smem.at[slot].transpose((1, 0)))
            plgpu.wgmma_wait(0)  # the slot is read: refill it

            @pl.when(i + stages < n_steps)
            def _():
                issue(i + stages, slot)

        return acc_ref[...]

    acc = pl.run_scoped(acc_scope, plgpu.ACC((bn, t.m_pad), jnp.float32))
    o_smem[...] = acc
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[sp, pl.ds(n0, bn)])
    plgpu.wait_smem_to_gmem(0)


_STATIC = ("block_n", "block_k", "splits", "stages", "reduce")


@functools.partial(jax.jit, static_argnames=_STATIC)
def skinny_matmul_mgpu(
    x,
    w,
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    splits: int | None = None,
    stages: int | None = None,
    reduce: bool = True,
):
    """``x [M, K] @ w [K, *out]`` (module docstring). ``reduce=True``: ``[M, *out]`` in ``x``'s
    dtype; ``reduce=False``: the f32 partials ``[splits, M, *out]`` of the K splits (their sum is
    the product; ``skinny_tuning(...).splits`` of them)."""
    m, k, n = _check(x, w, kernel=True)
    t = skinny_tuning(m, k, n, x.dtype.itemsize, block_n=block_n, block_k=block_k, splits=splits, stages=stages)
    out_shape = tuple(w.shape[1:])
    w2 = w.reshape(k, n)
    if m != t.m_pad:
        x = jnp.pad(x, ((0, t.m_pad - m), (0, 0)))
    k_steps = _cdiv(k, t.block_k)
    swz = (plgpu.TilingTransform((8, SWIZZLE // x.dtype.itemsize)), plgpu.SwizzleTransform(SWIZZLE))
    out_swizzle = min(SWIZZLE, t.m_pad * 4)
    out_ts = (plgpu.TilingTransform((8, out_swizzle // 4)), plgpu.SwizzleTransform(out_swizzle))

    def entry(x_ref, w_ref, o_ref):
        pl.run_scoped(
            functools.partial(_kernel, x_ref, w_ref, o_ref, t=t, k_steps=k_steps),
            plgpu.SMEM((t.stages, t.m_pad, t.block_k), x.dtype, transforms=swz),
            plgpu.SMEM((t.stages, t.block_k, t.block_n), x.dtype, transforms=swz),
            plgpu.SMEM((t.block_n, t.m_pad), jnp.float32, transforms=out_ts),
            plgpu.Barrier(num_arrivals=2, num_barriers=t.stages),
        )

    part_t = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((t.splits, n, t.m_pad), jnp.float32),
        grid=t.grid(n),
        grid_names=("n", "split"),
    )(x, w2)
    return _finish(part_t, m, out_shape, x.dtype, reduce)


@functools.partial(jax.jit, static_argnames=_STATIC)
def skinny_matmul_reference(
    x,
    w,
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    splits: int | None = None,
    stages: int | None = None,
    reduce: bool = True,
):
    """jnp twin of :func:`skinny_matmul_mgpu` (same arguments and outputs): f32 partials over the
    same K ranges (split ``s`` covers ``[s * steps_per_split * block_k, ...)``, the last clipped
    at K), exact products accumulated in f32. Also takes float32 (CPU checks)."""
    m, k, n = _check(x, w, kernel=False)
    t = skinny_tuning(m, k, n, 2, block_n=block_n, block_k=block_k, splits=splits, stages=stages)
    chunk = t.steps_per_split * t.block_k
    kp = t.splits * chunk
    xs = jnp.pad(x, ((0, 0), (0, kp - k))).reshape(m, t.splits, chunk)
    ws = jnp.pad(w.reshape(k, n), ((0, kp - k), (0, 0))).reshape(t.splits, chunk, n)
    # products of 16-bit inputs are exact in f32: upcasting first is the kernel's arithmetic (and runs on CPU)
    f32 = jnp.float32
    part = jnp.einsum("msc,scn->snm", xs.astype(f32), ws.astype(f32), precision="highest")  # [splits, N, M]
    return _finish(part, m, tuple(w.shape[1:]), x.dtype, reduce)
