"""``x @ w`` for a few decode rows on Hopper (Pallas, Mosaic GPU): issue 36's projections.

With M = 1..16 rows, ``x [M, K] @ w [K, N]`` is reading ``w`` once; compute is an afterthought.
One CTA = (a column block of ``block_n`` columns, a K split). A split owns ``steps_per_split`` whole
``block_k`` steps (the last may own fewer; none is empty), so the grid is ``N / block_n x splits``
CTAs. The CTA's one warpgroup runs a ring of ``stages`` shared-memory slots, each filled by two
TMA copies on one barrier (a weight tile ``[block_k, block_n]``, wgmma's B operand, and the
matching ``[R, block_k]`` slice of ``x``, ``R`` its rows rounded up to 8); it waits for the slot,
issues the wgmma into a ``[64, block_n]`` f32 accumulator, waits for it and refills the slot with
the step ``stages`` ahead, so ``stages`` weight tiles are in flight. wgmma's A operand has 64 rows:
the ``R <= 16`` rows that TMA copies fill the top of a 64-row tile zeroed once, and only those rows
of the accumulator are stored (an output row reads only its own row of A). Each CTA writes its f32
partial ``[R, block_n]``; ``decode_gemm_mgpu`` returns the sum of the splits (XLA fuses it into the
consumer) or the partials themselves.

(A skinny GEMM measured at ``c47db58`` computed ``y^T = w^T x^T`` instead and lost in the engine to
the transpose-and-sum that its output needed; nothing here is transposed.)

Also the building blocks of ``decode_mlp_mgpu`` (its down projection is this kernel). K must be a
multiple of 64 and N of 16; ``block_n`` (16, 32 or 64: 32-, 64- or 128-byte tile rows, the swizzle
wgmma's operands share) must divide N. :func:`decode_gemm_reference` is the jnp twin
(the same f32 partials over the same K ranges; it also takes float32). The CPU tests cross-lower
the kernel for CUDA and run it in Pallas' GPU interpreter with wgmma, which the interpreter does not
model, stood in for; the GPU tests compare kernel and twin.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = [
    "MAX_ROWS",
    "GemmTuning",
    "decode_gemm_mgpu",
    "decode_gemm_reference",
    "gemm_tuning",
    "supported",
]

MAX_ROWS = 16  # rows one launch serves: the rows TMA moves into the A operands and out of the accumulators
ROW_GROUP = 8  # launches move rows in whole groups of 8 (the swizzle tiles' rows): 1..7 rows are padded
A_ROWS = 64  # wgmma's M: the A operand's rows, the first MAX_ROWS of them real
BLOCK_N = 64  # default weight columns per CTA (wgmma's N): 128-byte tile rows, the widest swizzle
BLOCK_NS = (16, 32, 64)  # the widths whose 16-bit rows are a swizzle (32, 64, 128 bytes)
TILE_BYTES = 16 * 1024  # a 64-column weight tile per pipeline step (the default block_k)
NUM_SMS = 132  # an H200
SMEM_LIMIT = 227 * 1024 - 1024  # per CTA on Hopper, less the barriers
MAX_STAGES = 8


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def swizzled(row_elems: int, itemsize: int) -> tuple:
    """Tiling and swizzle of a shared-memory tile whose swizzled rows are ``row_elems`` long."""
    row_bytes = min(128, row_elems * itemsize)
    return plgpu.TilingTransform((8, row_bytes // itemsize)), plgpu.SwizzleTransform(row_bytes)


def stage_bytes(block_k: int, block_n: int, weight_tiles: int, itemsize: int = 2) -> int:
    """One ring slot: ``weight_tiles`` weight tiles ``[block_k, block_n]`` and the A tile ``[64, block_k]``."""
    return (weight_tiles * block_k * block_n + A_ROWS * block_k) * itemsize


def default_block_k(itemsize: int = 2) -> int:
    return max(64, TILE_BYTES // (BLOCK_N * itemsize) // 64 * 64)


def check_knobs(block_k: int, **block_ns: tuple[int, int]) -> None:
    """``ValueError`` for a ``block_k`` that is not whole swizzle atoms or a ``name=(block_n, N)``
    whose width is not one of ``BLOCK_NS`` dividing N."""
    if block_k < 64 or block_k % 64:
        raise ValueError(f"block_k={block_k} must be a positive multiple of 64 (128-byte swizzle atoms)")
    for name, (bn, n) in block_ns.items():
        if bn not in BLOCK_NS or n % bn:
            raise ValueError(f"{name}={bn} must be one of {BLOCK_NS} and divide {n}")


def fit_stages(per_stage: int, staging: int, steps: int, given: int | None, name: str) -> int:
    """Ring slots: ``given``, else as many as fit a CTA's shared memory (at most ``MAX_STAGES``);
    cut to ``steps`` (more would stay empty); ``ValueError`` where they do not fit."""
    if given is None:
        given = max(1, min(MAX_STAGES, (SMEM_LIMIT - staging) // per_stage))
    if given < 1:
        raise ValueError(f"{name}={given} must be >= 1")
    given = min(given, steps)
    if given * per_stage + staging > SMEM_LIMIT:
        raise ValueError(f"{name}={given} need {given * per_stage + staging} B of shared memory > {SMEM_LIMIT}")
    return given


def zero_pad_rows(ref, stages: int) -> None:
    """Zero every slot of an A-operand ring before its first TMA copy: TMA fills only the first
    ``MAX_ROWS`` rows, and the other rows would only put garbage into output rows that are never
    stored; zeroed all the same (whole 64-row slots: a register array's rows come in 64s)."""
    for slot in range(stages):
        ref[slot] = jnp.zeros(ref.shape[1:], ref.dtype)
    plgpu.commit_smem()  # the writes above, before the TMA copies and the tensor cores (async proxy)


@dataclasses.dataclass(frozen=True)
class GemmTuning:
    """Static knobs of one launch (``gemm_tuning`` checks and normalises them)."""

    block_k: int  # K per pipeline step (a multiple of 64)
    splits: int  # K ranges (grid dimension), none empty
    steps_per_split: int
    stages: int  # ring slots: a weight tile and x's slice each
    block_n: int = BLOCK_N  # N columns per CTA

    def grid(self, n: int) -> tuple[int, int]:
        return n // self.block_n, self.splits

    def smem_bytes(self, itemsize: int = 2) -> int:
        """Shared memory of one CTA: the ring and the f32 output staging."""
        return self.stages * stage_bytes(self.block_k, self.block_n, 1, itemsize) + A_ROWS * self.block_n * 4


def gemm_tuning(
    k: int,
    n: int,
    itemsize: int = 2,
    *,
    block_k: int | None = None,
    splits: int | None = None,
    stages: int | None = None,
    block_n: int | None = None,
    target_ctas: int = NUM_SMS,
    knob_prefix: str = "",
) -> GemmTuning:
    """Defaults for ``[M, k] @ [k, n]``; any knob given overrides its default (checked: ``ValueError``).

    ``block_k``: a ``TILE_BYTES`` weight tile per step at 64 columns. ``splits``: enough K ranges
    that the ``n / block_n`` column blocks reach ``target_ctas`` (one CTA an SM), cut to the steps
    and normalised so that none is empty. ``stages``: as many slots as fit a CTA's shared memory.
    ``block_n``: the widest of ``BLOCK_NS`` that divides ``n``.
    ``knob_prefix``: before the knobs' names in errors (``down_`` for the MLP's down launch)."""
    block_k = default_block_k(itemsize) if block_k is None else block_k
    if block_n is None:
        block_n = max([b for b in BLOCK_NS if n % b == 0], default=BLOCK_N)
    check_knobs(block_k, **{f"{knob_prefix}block_n": (block_n, n)})
    steps = cdiv(k, block_k)
    if splits is None:
        splits = max(1, target_ctas // (n // block_n))
    if splits < 1:
        raise ValueError(f"{knob_prefix}splits={splits} must be >= 1")
    per_split = cdiv(steps, min(splits, steps))
    splits = cdiv(steps, per_split)
    per_stage = stage_bytes(block_k, block_n, 1, itemsize)
    stages = fit_stages(per_stage, A_ROWS * block_n * 4, per_split, stages, f"{knob_prefix}stages")
    return GemmTuning(int(block_k), int(splits), int(per_split), int(stages), int(block_n))


def rows_and_dtype_unsupported(dtype, m: int) -> str | None:
    """Why a launch of these kernels cannot take ``m`` rows of ``dtype`` (``None`` when it can):
    the check ``decode_mlp_mgpu`` shares."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name} (needs bfloat16 or float16)"
    if not 1 <= m <= MAX_ROWS:
        return f"{m} rows (needs 1..{MAX_ROWS})"
    return None


def supported(dtype, m: int, k: int, n: int) -> str | None:
    """Why the kernel cannot serve ``[m, k] @ [k, n]`` in ``dtype`` (``None`` when it can)."""
    why = rows_and_dtype_unsupported(dtype, m)
    if why is not None:
        return why
    if k < 64 or k % 64:
        return f"K={k} (needs a multiple of 64: x's tiles are whole swizzle atoms)"
    if n < 16 or n % 16:
        return f"N={n} (needs a multiple of 16: the narrowest CTA)"
    return None


def _gemm_kernel(x_ref, w_ref, o_ref, x_smem, w_smem, o_smem, ready, *, t: GemmTuning, k_steps: int):
    """One CTA: the f32 partial ``y[:, n0:n0+block_n]`` of its K range."""
    bk, stages, sps, bn = t.block_k, t.stages, t.steps_per_split, t.block_n
    rows = x_ref.shape[0]  # a whole number of ROW_GROUPs
    n0 = lax.axis_index("n") * bn
    sp = lax.axis_index("split")
    step0 = sp * sps
    n_steps = jnp.minimum(sps, k_steps - step0)  # >= 1: the tuning leaves no split empty
    zero_pad_rows(x_smem, stages)

    def issue(i, slot):
        k0 = (step0 + i) * bk
        plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(k0, bk), pl.ds(n0, bn)], w_smem.at[slot], ready.at[slot])
        plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds(k0, bk)], x_smem.at[slot, pl.ds(0, rows)], ready.at[slot])

    for i in range(stages):

        @pl.when(i < n_steps)
        def _():
            issue(jnp.int32(i), i)

    def acc_scope(acc_ref):
        @pl.loop(0, n_steps)
        def _(i):
            slot = lax.rem(i, jnp.int32(stages))
            plgpu.barrier_wait(ready.at[slot])
            plgpu.wgmma(acc_ref, x_smem.at[slot], w_smem.at[slot])
            plgpu.wgmma_wait(0)  # the slot is read: refill it

            @pl.when(i + stages < n_steps)
            def _():
                issue(i + stages, slot)

        return acc_ref[...]

    o_smem[...] = pl.run_scoped(acc_scope, plgpu.ACC((A_ROWS, bn), jnp.float32))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows)], o_ref.at[sp, :, pl.ds(n0, bn)])
    plgpu.wait_smem_to_gmem(0)


def gemm_call(x, w, t: GemmTuning):
    """The launch: ``x [R, K] @ w [K, N]`` -> the f32 partials ``[splits, R, N]`` (``R``: ``pad_rows``')."""
    k, n = w.shape
    dt, size, bn = x.dtype, x.dtype.itemsize, t.block_n
    tiles = swizzled(bn, size)  # wgmma takes A and B in one swizzle: the weight tiles' rows

    def entry(x_ref, w_ref, o_ref):
        pl.run_scoped(
            functools.partial(_gemm_kernel, x_ref, w_ref, o_ref, t=t, k_steps=cdiv(k, t.block_k)),
            plgpu.SMEM((t.stages, A_ROWS, t.block_k), dt, transforms=tiles),
            plgpu.SMEM((t.stages, t.block_k, bn), dt, transforms=tiles),
            plgpu.SMEM((A_ROWS, bn), jnp.float32, transforms=swizzled(bn, 4)),
            plgpu.Barrier(num_arrivals=2, num_barriers=t.stages),
        )

    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((t.splits, x.shape[0], n), jnp.float32),
        grid=t.grid(n),
        grid_names=("n", "split"),
    )(x, w)


def pad_rows(x):
    """``x [M, K]`` -> ``[R, K]``, ``R`` = M rounded up to a whole ``ROW_GROUP``: what the launches read
    and write. The engine's decode buckets (8, 16 rows) need no pad, which would be one more XLA
    kernel (docs/roadmap.md has its cost)."""
    m = x.shape[0]
    r = cdiv(m, ROW_GROUP) * ROW_GROUP
    return x if r == m else jnp.pad(x, ((0, r - m), (0, 0)))


def _check(x, w, *, kernel: bool) -> tuple[int, int, int]:
    if x.ndim != 2 or w.ndim < 2:
        raise ValueError(f"x must be [M, K] and w [K, *out], got {x.shape} and {w.shape}")
    m, k = x.shape
    if w.shape[0] != k:
        raise ValueError(f"x {x.shape} and w {w.shape} disagree on K")
    if x.dtype != w.dtype:
        raise ValueError(f"x and w must share a dtype, got {x.dtype} and {w.dtype}")
    n = 1
    for s in w.shape[1:]:
        n *= s
    why = supported(x.dtype if kernel else jnp.bfloat16, m, k, n)
    if why is not None:
        raise ValueError(f"decode_gemm_mgpu cannot serve {why}")
    return m, k, n


def _finish(part, m: int, out_shape: tuple, reduce: bool):
    """``[splits, R >= M, N]`` partials -> ``[M, *out]`` (their sum) or ``[splits, M, *out]``."""
    part = part[:, :m].reshape(part.shape[0], m, *out_shape)
    return jnp.sum(part, axis=0) if reduce else part


_STATIC = ("block_k", "splits", "stages", "block_n", "reduce")


@functools.partial(jax.jit, static_argnames=_STATIC)
def decode_gemm_mgpu(x, w, *, block_k=None, splits=None, stages=None, block_n=None, reduce=True):
    """``x [M, K] @ w [K, *out]`` (module docstring). ``reduce=True``: ``[M, *out]`` in float32;
    ``reduce=False``: the f32 partials ``[splits, M, *out]`` of the K splits (their sum is the product)."""
    m, k, n = _check(x, w, kernel=True)
    t = gemm_tuning(k, n, x.dtype.itemsize, block_k=block_k, splits=splits, stages=stages, block_n=block_n)
    return _finish(gemm_call(pad_rows(x), w.reshape(k, n), t), m, w.shape[1:], reduce)


def split_products(x, w, t: GemmTuning):
    """The twin's partials: f32 products of ``x [M, K]`` and ``w [K, N]`` over ``t``'s K ranges
    (split ``s`` covers ``[s * steps_per_split * block_k, ...)``, the last clipped at K), exact
    for 16-bit inputs."""
    (m, k), n = x.shape, w.shape[1]
    chunk = t.steps_per_split * t.block_k
    kp = t.splits * chunk
    f32 = jnp.float32
    xs = jnp.pad(x.astype(f32), ((0, 0), (0, kp - k))).reshape(m, t.splits, chunk)
    ws = jnp.pad(w.astype(f32), ((0, kp - k), (0, 0))).reshape(t.splits, chunk, n)
    return jnp.einsum("msc,scn->smn", xs, ws, precision="highest")


@functools.partial(jax.jit, static_argnames=_STATIC)
def decode_gemm_reference(x, w, *, block_k=None, splits=None, stages=None, block_n=None, reduce=True):
    """jnp twin of :func:`decode_gemm_mgpu` (same arguments and outputs). Also takes float32."""
    m, k, n = _check(x, w, kernel=False)
    t = gemm_tuning(k, n, 2, block_k=block_k, splits=splits, stages=stages, block_n=block_n)
    return _finish(split_products(x, w.reshape(k, n), t), m, w.shape[1:], reduce)
